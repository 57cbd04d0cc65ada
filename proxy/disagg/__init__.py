"""Prefill/decode disaggregation: the pure parts (docs/disaggregation.md).

- `legs`: the request bodies of the two-leg flows (vLLM's KV-transfer params, SGLang's
  bootstrap fields);
- `pools`: which backends form the prefill-heavy and decode-heavy pools, and where one request
  goes;
- `window`: the sliding window of measured traffic (with long-prefill overlap tracking);
- `decider`: `disagg.mode: auto`, turning the split on and off from that window;
- `replay`: feeds finished request records (bench results) through a window in time order.

No I/O and no clock: times are passed in, so every decision is a deterministic test.
"""
