{{/* vim: set filetype=mustache: */}}

{{- define "maskd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Fully qualified app name, at most 50 characters so that suffixes such as "-headless",
"-directory" and KubeRay's "-head-svc" stay within the 63-character DNS label limit.
*/}}
{{- define "maskd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "maskd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "maskd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "maskd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "maskd.labels" -}}
helm.sh/chart: {{ include "maskd.chart" . }}
{{ include "maskd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: maskd
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "maskd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "maskd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "maskd.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) -}}
{{- end -}}
{{- end -}}

{{- define "maskd.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
{{- if kindIs "string" . }}
  - name: {{ . }}
{{- else }}
  - {{ toYaml . | nindent 4 | trim }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Integer values arrive as float64 from JSON/YAML: print them as plain integers. */}}
{{- define "maskd.int" -}}
{{- printf "%d" (int64 .) -}}
{{- end -}}

{{/*
The maskd server flags shared by `maskd serve` and `maskd cluster up`, as a JSON array: one flag
per line of server-flags.yaml whose value is set, then TLS, then server.extraArgs.
Call with (dict "root" $ "threads" N); threads defaults to server.threads.
*/}}
{{- define "maskd.serverFlags" -}}
{{- $root := .root -}}
{{- if and $root.Values.auth.enabled (not $root.Values.tls.enabled) (not $root.Values.auth.allowPlaintext) -}}
{{- fail "auth.enabled sends bearer tokens in the clear without tls.enabled: enable TLS, or set auth.allowPlaintext: true (a network you trust)" -}}
{{- end -}}
{{- $s := deepCopy $root.Values.server -}}
{{- if not (kindIs "invalid" .threads) }}{{ $_ := set $s "threads" .threads }}{{ end -}}
{{- $flags := list -}}
{{- range ($root.Files.Get "server-flags.yaml" | fromYamlArray) -}}
{{- $v := index $s .value -}}
{{- if kindIs "invalid" $v -}}
{{- else if eq .type "bool" -}}
{{- $flags = append $flags (ternary .flag (printf "--no-%s" (trimPrefix "--" .flag)) $v) -}}
{{- else if eq .type "int" -}}
{{- $flags = concat $flags (list .flag (include "maskd.int" $v)) -}}
{{- else -}}
{{- $flags = concat $flags (list .flag (toString $v)) -}}
{{- end -}}
{{- end -}}
{{- if and $root.Values.auth.enabled $root.Values.auth.tokensSecretName -}}
{{- $flags = concat $flags (list "--auth-tokens-file" (printf "%s/%s" $root.Values.auth.mountPath $root.Values.auth.tokensSecretKey)) -}}
{{- end -}}
{{- if $root.Values.auth.allowPlaintext -}}
{{- $flags = append $flags "--allow-plaintext-auth" -}}
{{- end -}}
{{- if and $root.Values.tls.enabled $root.Values.tls.clientCAKey -}}
{{- $flags = concat $flags (list "--tls-client-ca" (printf "%s/%s" $root.Values.tls.mountPath $root.Values.tls.clientCAKey)) -}}
{{- end -}}
{{- if $root.Values.tls.enabled -}}
{{- $flags = concat $flags (list "--tls-cert" (printf "%s/%s" $root.Values.tls.mountPath $root.Values.tls.certKey) "--tls-key" (printf "%s/%s" $root.Values.tls.mountPath $root.Values.tls.keyKey)) -}}
{{- end -}}
{{- range $s.extraArgs -}}
{{- $flags = append $flags (toString .) -}}
{{- end -}}
{{- toJson $flags -}}
{{- end -}}

{{/* Environment shared by every container that runs maskd code. */}}
{{- define "maskd.env" -}}
# Writable home for tokenizer and Hugging Face caches (the root filesystem is read-only).
- name: HOME
  value: /tmp
{{- if and .Values.auth.enabled .Values.auth.secretName }}
- name: MASKD_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.auth.secretName }}
      key: {{ .Values.auth.secretKey }}
{{- end }}
{{- with .Values.server.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "maskd.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- if and .Values.auth.enabled .Values.auth.tokensSecretName }}
- name: auth-tokens
  mountPath: {{ .Values.auth.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "maskd.volumes" -}}
- name: tmp
  emptyDir: {}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
    items:
      - key: {{ .Values.tls.certKey }}
        path: {{ .Values.tls.certKey }}
      - key: {{ .Values.tls.keyKey }}
        path: {{ .Values.tls.keyKey }}
      {{- with .Values.tls.clientCAKey }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}
{{- if and .Values.auth.enabled .Values.auth.tokensSecretName }}
- name: auth-tokens
  secret:
    secretName: {{ .Values.auth.tokensSecretName }}
    defaultMode: 0440
    items:
      - key: {{ .Values.auth.tokensSecretKey }}
        path: {{ .Values.auth.tokensSecretKey }}
{{- end }}
{{- end -}}

{{/* "grpc" or "tcp", from probes.type and tls.enabled. */}}
{{- define "maskd.probeType" -}}
{{- if eq .Values.probes.type "auto" -}}
{{- ternary "tcp" "grpc" .Values.tls.enabled -}}
{{- else -}}
{{- .Values.probes.type -}}
{{- end -}}
{{- end -}}

{{/*
One probe. Call with (dict "root" $ "probe" .Values.probes.readiness).
*/}}
{{- define "maskd.probe" -}}
{{- $root := .root -}}
{{- $p := .probe -}}
{{- if eq (include "maskd.probeType" $root) "grpc" }}
grpc:
  port: {{ include "maskd.int" $root.Values.server.port }}
  {{- if $p.service }}
  service: {{ $p.service | quote }}
  {{- end }}
{{- else }}
tcpSocket:
  port: grpc
{{- end }}
periodSeconds: {{ include "maskd.int" $p.periodSeconds }}
timeoutSeconds: {{ include "maskd.int" $p.timeoutSeconds }}
failureThreshold: {{ include "maskd.int" $p.failureThreshold }}
{{- if $p.successThreshold }}
successThreshold: {{ include "maskd.int" $p.successThreshold }}
{{- end }}
{{- end -}}

{{- define "maskd.preStop" -}}
{{- if eq .Values.preStop.type "sleep" }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ include "maskd.int" .Values.preStop.seconds }}
{{- else if eq .Values.preStop.type "exec" }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ include "maskd.int" .Values.preStop.seconds | quote }}]
{{- end }}
{{- end -}}

{{/* Workers a `maskd cluster up` starts. */}}
{{- define "maskd.ray.workers" -}}
{{- if kindIs "invalid" .Values.ray.clusterUp.workers -}}
{{- include "maskd.int" .Values.ray.worker.replicas -}}
{{- else -}}
{{- include "maskd.int" .Values.ray.clusterUp.workers -}}
{{- end -}}
{{- end -}}

{{/* Value of rayStartParams.resources: a quoted JSON object, as KubeRay expects. */}}
{{- define "maskd.ray.customResources" -}}
{{- printf "%q" (toJson .Values.ray.worker.customResources) -}}
{{- end -}}

{{/* One POSIX-shell word: single-quoted, embedded single quotes escaped. */}}
{{- define "maskd.shellQuote" -}}
{{- printf "'%s'" (replace "'" "'\\''" .) -}}
{{- end -}}

{{/*
Fails the render when a name the chart derives would be refused at install time: Services and
KubeRay's RayCluster need DNS-1035 labels (lowercase letters, digits and '-', starting with a
letter; KubeRay v1.7.0 also caps a RayCluster name at 53 characters, the fullname at 50).
*/}}
{{- define "maskd.validateNames" -}}
{{- $name := include "maskd.fullname" . -}}
{{- $source := printf "a release named %q" .Release.Name -}}
{{- if .Values.fullnameOverride -}}
{{- $source = printf "fullnameOverride %q" .Values.fullnameOverride -}}
{{- else if .Values.nameOverride -}}
{{- $source = printf "a release named %q with nameOverride %q" .Release.Name .Values.nameOverride -}}
{{- end -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "maskd: %s gets the resource name %q, which is not a DNS-1035 label (lowercase letters, digits and '-', starting with a letter, ending with a letter or digit) as Kubernetes Services and KubeRay's RayCluster require; install under a name that starts with a letter, or set fullnameOverride" $source $name) -}}
{{- end -}}
{{- if and .Values.serviceAccount.name (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" .Values.serviceAccount.name)) -}}
{{- fail (printf "maskd: serviceAccount.name %q is not a DNS-1123 subdomain (lowercase letters, digits, '-' and '.')" .Values.serviceAccount.name) -}}
{{- end -}}
{{- end -}}
