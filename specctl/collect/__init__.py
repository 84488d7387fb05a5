"""The collect stage: `specctl collect-hidden-states`, from conversations through the verifier to
a feature store.

capture.py runs the verifier over the store's shards (HF in this process, or vLLM through
specctl.vllm.collect, which lives with the rest of the vLLM code) and writes them; claims.py is how
workers share the shards. The store's format (specctl.features), its disk estimate
(specctl.estimate) and the origin it records (specctl.recipe_origin) are read by training too, so
they stay below the stages. The entry point is re-exported: `from specctl.collect import collect`.
"""

from specctl.collect.capture import CollectSummary, collect

__all__ = ["CollectSummary", "collect"]
