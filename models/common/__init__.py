"""Building blocks the decoder families share (not a family: nothing is registered here).

Llama 3, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3 and gpt-oss are one decoder (``decoder.py``: pre-norm blocks of an
attention and a feed-forward part, the naming contract of models/spec.py) assembled from these parts:

- ``norm.py`` RMSNorm; ``rope.py`` rotary positions (plain, Llama 3 scaled or YaRN); ``attention.py`` grouped-query
  attention with optional per-head q/k norms (Qwen3), biases, sinks and sliding windows (gpt-oss);
  ``latent_attention.py`` multi-head latent attention (DeepSeek-V3); ``attention_core.py`` the causal core both call
  (documents, context parallelism), on ``banded_attention.py``'s operator for windows and sinks; ``mlp.py`` the
  SwiGLU MLP;
- ``moe.py`` the mixture-of-experts block (router ``router.py``, stacked experts computed by the grouped
  matrix product of ``grouped_mm.py``, or a family's own experts module, load balancing ``load_balance.py``);
- ``hf_layout.py`` the Hugging Face tensor names of such a decoder, ``hf_config.py`` the config.json keys
  they share.

Nothing here knows about ranks: the engine parallelises these modules from outside.
"""
