"""maskd_cluster: maskd on Ray.

- ``worker``: a Ray actor hosting a maskd gRPC server on its node (one network hop from a GPU worker).
- ``directory``: the Directory gRPC service (live workers, sequence -> worker by consistent hashing),
  hosted in a Ray actor but reachable without Ray.
- ``store``: the cluster-wide grammar cache (compile once per cluster; errors too).
- ``launcher`` / ``cli``: ``maskd cluster up | status | down``.

Import-light: ``hashring`` and ``directory_client`` need no Ray (a GPU worker uses them through
``maskd_client``); the Ray modules import Ray themselves.
"""
NAMESPACE = "maskd"
DIRECTORY_NAME = "maskd-directory"
STORE_NAME = "maskd-grammar-store"
WORKER_PREFIX = "maskd-worker-"


def worker_id(index: int) -> str:
    return f"worker-{index}"


def worker_actor_name(wid: str) -> str:
    return WORKER_PREFIX + wid.removeprefix("worker-")
