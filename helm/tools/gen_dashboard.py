"""Generates helm/maskd/dashboards/maskd-overview.json, the Grafana dashboard the chart ships.

    python helm/tools/gen_dashboard.py      # rewrites the JSON next to the chart

tests/test_helm.py checks that the shipped file equals build().
"""
import json

SEL = 'namespace=~"$namespace", job=~"$job", pod=~"$pod"'
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
panels: list = []
pid = [0]
y = [0]


def nid():
    pid[0] += 1
    return pid[0]


def row(title):
    panels.append({"id": nid(), "type": "row", "title": title, "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y[0]}, "panels": []})
    y[0] += 1


def target(expr, legend, ref):
    return {"datasource": DS, "refId": ref, "expr": expr, "legendFormat": legend, "range": True}


def ts(title, desc, targets, unit, x, w=12, h=8, extra_defaults=None, stack=False):
    defaults = {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                                         "stacking": {"mode": "normal" if stack else "none", "group": "A"}}}
    if extra_defaults:
        defaults.update(extra_defaults)
    panels.append({
        "id": nid(), "type": "timeseries", "title": title, "description": desc, "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y[0]},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max", "lastNotNull"],
                               "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [target(expr, legend, chr(65 + i)) for i, (expr, legend) in enumerate(targets)],
    })


def stat(title, desc, expr, unit, x, w=4, thresholds=None, decimals=None):
    defaults = {"unit": unit, "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": thresholds or [{"color": "green", "value": None}]}}
    if decimals is not None:
        defaults["decimals"] = decimals
    panels.append({
        "id": nid(), "type": "stat", "title": title, "description": desc, "datasource": DS,
        "gridPos": {"h": 4, "w": w, "x": x, "y": y[0]},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto"},
        "targets": [target(expr, "", "A")],
    })


def q(quant, metric, by="le"):
    return f'histogram_quantile({quant}, sum by ({by}) (rate({metric}_bucket{{{SEL}}}[{RI}])))'


def hit_ratio(by):
    hits = f'sum by ({by}) (rate(maskd_grammar_cache_hits_total{{{SEL}}}[{RI}]))'
    misses = f'sum by ({by}) (rate(maskd_grammar_cache_misses_total{{{SEL}}}[{RI}]))'
    return f'{hits} / ({hits} + {misses})'


def var_query(name, label, query, multi=True, include_all=True):
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query,
            "refresh": 2, "sort": 1, "multi": multi, "includeAll": include_all, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0}



def build() -> dict:
    panels.clear()
    pid[0] = 0
    y[0] = 0
    # overview
    row("Overview")
    stat("Servers up", "maskd targets Prometheus scrapes successfully.",
         f'sum(up{{{SEL}}})', "none", 0,
         thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 1}])
    stat("Steps / s", "Decode-step messages answered per second, all servers.",
         f'sum(rate(maskd_step_seconds_count{{{SEL}}}[{RI}]))', "reqps", 4)
    stat("Step latency p99", "99th percentile of server time per decode step.",
         q(0.99, "maskd_step_seconds"), "s", 8,
         thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 0.005},
                     {"color": "red", "value": 0.02}])
    stat("Live sequences", "Open sequences, all servers.", f'sum(maskd_live_sequences{{{SEL}}})', "none", 12)
    stat("Waiting for grammar", "Sequences whose grammar is still compiling.",
         f'sum(maskd_waiting_sequences{{{SEL}}})', "none", 16,
         thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1}])
    stat("Errors / s", "All maskd errors, every kind.", f'sum(rate(maskd_errors_total{{{SEL}}}[{RI}])) or vector(0)',
         "reqps", 20,
         thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 0.01}])
    y[0] += 4

    # ---------------------------------------------------------------- latency
    row("Latency")
    ts("Step latency (p50 / p99 / p99.9)",
       "Server time per decode step, request parsed to reply built: histogram_quantile over rate of "
       "maskd_step_seconds_bucket.",
       [(q(0.5, "maskd_step_seconds"), "p50"), (q(0.99, "maskd_step_seconds"), "p99"),
        (q(0.999, "maskd_step_seconds"), "p99.9")], "s", 0)
    ts("Step latency p99 by pod", "Finds the slow replica.",
       [(q(0.99, "maskd_step_seconds", "le, pod"), "{{pod}}")], "s", 12)
    y[0] += 8
    ts("Mask fill time (p50 / p99)",
       "Batched mask fill per step (maskd_mask_fill_seconds). The gap to step latency is protocol and encoding "
       "overhead.",
       [(q(0.5, "maskd_mask_fill_seconds"), "p50"), (q(0.99, "maskd_mask_fill_seconds"), "p99")], "s", 0)
    ts("Compile time by backend (p50 / p99)",
       "Grammar compile time (maskd_compile_seconds). Long xgrammar compiles are why the shared cache exists.",
       [(q(0.5, "maskd_compile_seconds", "le, backend"), "p50 {{backend}}"),
        (q(0.99, "maskd_compile_seconds", "le, backend"), "p99 {{backend}}")], "s", 12)
    y[0] += 8
    ts("Step batch size (p50 / p99)", "Sequences per step message (maskd_step_batch_size).",
       [(q(0.5, "maskd_step_batch_size"), "p50"), (q(0.99, "maskd_step_batch_size"), "p99")], "none", 0)
    ts("Steps / s by pod", "Step throughput per replica (count of maskd_step_seconds).",
       [(f'sum by (pod) (rate(maskd_step_seconds_count{{{SEL}}}[{RI}]))', "{{pod}}")], "reqps", 12)
    y[0] += 8
    ts("Slow steps / s by pod",
       "Steps over --slow-step (maskd_slow_steps_total; 20 ms by default). The server logs each one's phases "
       "(lock, route, consume, fill, answer) and CPU, at most one line a second: read them there.",
       [(f'sum by (pod) (rate(maskd_slow_steps_total{{{SEL}}}[{RI}])) or vector(0)', "{{pod}}")], "reqps", 0)
    y[0] += 8

    # ---------------------------------------------------------------- grammar cache
    row("Grammar cache")
    ts("Grammar cache hit ratio", "hits / (hits + misses) per cache level (local process cache, shared cluster cache).",
       [(hit_ratio("cache"), "{{cache}}")], "percentunit", 0,
       extra_defaults={"min": 0, "max": 1})
    ts("Grammar cache lookups / s", "maskd_grammar_cache_hits_total and maskd_grammar_cache_misses_total by cache.",
       [(f'sum by (cache) (rate(maskd_grammar_cache_hits_total{{{SEL}}}[{RI}]))', "hits {{cache}}"),
        (f'sum by (cache) (rate(maskd_grammar_cache_misses_total{{{SEL}}}[{RI}]))', "misses {{cache}}")], "ops", 12)
    y[0] += 8
    ts("Compiled grammars held", "maskd_grammar_cache_entries per pod.",
       [(f'sum by (pod) (maskd_grammar_cache_entries{{{SEL}}})', "{{pod}}")], "none", 0)
    ts("Compiles / s by backend", "Rate of maskd_compile_seconds observations.",
       [(f'sum by (backend) (rate(maskd_compile_seconds_count{{{SEL}}}[{RI}]))', "{{backend}}")], "ops", 12)
    y[0] += 8

    # ---------------------------------------------------------------- sequences
    row("Sequences and streams")
    ts("Live and waiting sequences",
       "maskd_live_sequences and maskd_waiting_sequences (grammar not compiled yet), all servers.",
       [(f'sum(maskd_live_sequences{{{SEL}}})', "live"), (f'sum(maskd_waiting_sequences{{{SEL}}})', "waiting")],
       "none", 0)
    ts("Live sequences and open streams by pod",
       "Balance across replicas: maskd_live_sequences and maskd_open_streams.",
       [(f'sum by (pod) (maskd_live_sequences{{{SEL}}})', "live {{pod}}"),
        (f'sum by (pod) (maskd_open_streams{{{SEL}}})', "streams {{pod}}")], "none", 12)
    y[0] += 8

    # ---------------------------------------------------------------- wire
    row("Mask rows on the wire")
    ts("Bytes per row",
       "Mean bytes sent per mask row, overall and by encoding (maskd_row_bytes sum / count). Dense rows of a 129k "
       "vocabulary are 16,160 B.",
       [(f'sum(rate(maskd_row_bytes_sum{{{SEL}}}[{RI}])) / sum(rate(maskd_row_bytes_count{{{SEL}}}[{RI}]))',
         "mean, all encodings"),
        (f'sum by (encoding) (rate(maskd_row_bytes_sum{{{SEL}}}[{RI}])) '
         f'/ sum by (encoding) (rate(maskd_row_bytes_count{{{SEL}}}[{RI}]))', "mean {{encoding}}"),
        (q(0.99, "maskd_row_bytes"), "p99, all encodings")], "bytes", 0)
    ts("Rows sent / s by encoding", "maskd_rows_sent_total by encoding (dense, id lists, dictionary references).",
       [(f'sum by (encoding) (rate(maskd_rows_sent_total{{{SEL}}}[{RI}]))', "{{encoding}}")], "ops", 12, stack=True)
    y[0] += 8
    ts("Row dictionary hit ratio",
       "Share of rows answered by a reference to a row the stream already carried "
       "(maskd_row_dictionary_lookups_total).",
       [(f'sum(rate(maskd_row_dictionary_lookups_total{{result="hit", {SEL}}}[{RI}])) '
         f'/ sum(rate(maskd_row_dictionary_lookups_total{{{SEL}}}[{RI}]))', "hit ratio")],
       "percentunit", 0, extra_defaults={"min": 0, "max": 1})
    ts("Mask bandwidth", "Bytes of mask rows sent per second (maskd_row_bytes_sum).",
       [(f'sum by (pod) (rate(maskd_row_bytes_sum{{{SEL}}}[{RI}]))', "{{pod}}")], "Bps", 12, stack=True)
    y[0] += 8

    # ---------------------------------------------------------------- complete JSON-schema mode
    row("JSON Schema validation (complete mode)")
    ts("Document checks per step (p50 / p99)",
       "maskd_validation_seconds: decoding, early checks of closed sub-documents and final checks before EOS, run "
       "beside the mask fill.",
       [(q(0.5, "maskd_validation_seconds"), "p50"), (q(0.99, "maskd_validation_seconds"), "p99")], "s", 0)
    ts("Sequences failed by the validator / s", "maskd_validation_failures_total by kind (final, early, eos, draft).",
       [(f'sum by (kind) (rate(maskd_validation_failures_total{{{SEL}}}[{RI}]))', "{{kind}}")], "ops", 12, stack=True)
    y[0] += 8

    # ---------------------------------------------------------------- errors
    row("Errors")
    ts("Errors by kind",
       "maskd_errors_total by kind: rejected tokens, divergence, limits, compile failures, shared-cache faults...",
       [(f'sum by (kind) (rate(maskd_errors_total{{{SEL}}}[{RI}]))', "{{kind}}")], "ops", 0, w=24, stack=True)
    y[0] += 8

    dashboard = {
        "title": "maskd",
        "uid": "maskd-overview",
        "description": "maskd token-mask servers: step latency, mask fill, compiles, grammar cache, sequences, "
                       "bytes on the wire, errors.",
        "tags": ["maskd", "llm", "structured-output"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": "", "includeAll": False, "multi": False},
            var_query("namespace", "Namespace", "label_values(maskd_live_sequences, namespace)"),
            var_query("job", "Job", 'label_values(maskd_live_sequences{namespace=~"$namespace"}, job)'),
            var_query("pod", "Pod", 'label_values(maskd_live_sequences{namespace=~"$namespace", job=~"$job"}, pod)'),
        ]},
        "panels": list(panels),
    }
    return dashboard


def main() -> None:
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "maskd" / "dashboards/maskd-overview.json"
    path.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
