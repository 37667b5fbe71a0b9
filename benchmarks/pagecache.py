"""Page-cache eviction for the benchmark scripts (run as scripts: this folder is on sys.path);
the function lives in hpctrain.bench.pagecache, shared with ``hpctrain bench``."""

from hpctrain.bench.pagecache import evict

__all__ = ["evict"]
