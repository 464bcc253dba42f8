"""Model families and Hugging Face checkpoints in and out (``dt.models``).

``from_pretrained`` reads a Hugging Face checkpoint (``config.json`` + safetensors)
straight into a strategy's layout, each process reading only its devices' slices;
``save_pretrained`` writes parameters in any layout back to the Hugging Face layout,
which ``transformers``, vLLM, SGLang, TGI and lm-eval read. The families: GPT-2
(:class:`LMConfig` with learned positions, distrain's own decoder), Llama / Mistral /
Qwen3 and Mixtral / Qwen3-MoE. LoRA: ``add_lora`` adapts a model's ``nnx.Linear``
layers, ``save_adapter`` / ``load_adapter`` write and read PEFT's format, ``merge_lora``
folds the adapters into the base for ``save_pretrained``. ``generate`` continues
prompts from a KV cache, under any strategy (``docs/evaluation.md``). ``docs/models.md``.

Example:
  >>> model = dt.models.from_pretrained("path/to/llama", strategy=strategy)
  >>> state = dt.TrainState.create(apply_fn=model.apply_fn, params=model.params, tx=tx)
  >>> dt.models.save_pretrained("exported", state, model)
"""

from typing import TYPE_CHECKING

from distrain._src import lazy as _lazy

# Importing a family's module registers it (import and export find families by name).
from distrain._src.models import gpt2 as _gpt2  # noqa: F401
from distrain._src.models import llama_family as _llama_family  # noqa: F401
from distrain._src.models import mixtral as _mixtral  # noqa: F401
from distrain._src.models.family import Family as Family
from distrain._src.models.family import Tensor as Tensor
from distrain._src.models.family import families as families
from distrain._src.models.generate import Generation as Generation
from distrain._src.models.generate import generate as generate
from distrain._src.models.hub import Pretrained as Pretrained
from distrain._src.models.hub import from_pretrained as from_pretrained
from distrain._src.models.hub import save_pretrained as save_pretrained
from distrain._src.models.llama import LOGICAL_AXIS_RULES as LOGICAL_AXIS_RULES
from distrain._src.models.llama import Llama as Llama
from distrain._src.models.llama import LlamaConfig as LlamaConfig
from distrain._src.models.llama import RopeScaling as RopeScaling
from distrain._src.models.llama import layout_for as layout_for
from distrain._src.models.lora import LoraConfig as LoraConfig
from distrain._src.models.lora import LoraLinear as LoraLinear
from distrain._src.models.lora import add_lora as add_lora
from distrain._src.models.lora import lora_dropout as lora_dropout
from distrain._src.models.lora import merge_lora as merge_lora
from distrain._src.models.mixtral import Mixtral as Mixtral
from distrain._src.models.mixtral import MixtralConfig as MixtralConfig
from distrain._src.models.moe_block import update_expert_bias as update_expert_bias
from distrain._src.models.peft_format import load_adapter as load_adapter
from distrain._src.models.peft_format import save_adapter as save_adapter
from distrain._src.models.transformer import EXPERT_LAYOUT as EXPERT_LAYOUT
from distrain._src.models.transformer import REMAT_POLICIES as REMAT_POLICIES
from distrain._src.models.transformer import TENSOR_PARALLEL_LAYOUT as TENSOR_PARALLEL_LAYOUT
from distrain._src.models.transformer import LMConfig as LMConfig
from distrain._src.models.transformer import Transformer as Transformer
from distrain._src.models.transformer import constrain_hidden as constrain_hidden
from distrain._src.models.transformer import count_params as count_params
from distrain._src.models.transformer import flops_per_token as flops_per_token
from distrain._src.models.transformer import make_apply_fn as make_apply_fn
from distrain._src.models.transformer import pipeline_layout as pipeline_layout
from distrain._src.models.transformer import transformer as transformer

# lm-evaluation-harness (the lm-eval extra) loads on first use of these names
# (distrain/_src/lazy.py); type checkers read them from the block below.
_LAZY = {
    "LMEvalCallback": "distrain._src.models.lm_eval_callback:LMEvalCallback",
    "LMEvalModel": "distrain._src.models.lm_eval:LMEvalModel",
}
if TYPE_CHECKING:
    from distrain._src.models.lm_eval import LMEvalModel as LMEvalModel
    from distrain._src.models.lm_eval_callback import LMEvalCallback as LMEvalCallback
else:
    __getattr__, __dir__ = _lazy.exports(globals(), _LAZY)

__all__ = [
    "EXPERT_LAYOUT",
    "LOGICAL_AXIS_RULES",
    "REMAT_POLICIES",
    "TENSOR_PARALLEL_LAYOUT",
    "Family",
    "Generation",
    "LMConfig",
    "LMEvalCallback",
    "LMEvalModel",
    "Llama",
    "LlamaConfig",
    "LoraConfig",
    "LoraLinear",
    "Mixtral",
    "MixtralConfig",
    "Pretrained",
    "RopeScaling",
    "Tensor",
    "Transformer",
    "add_lora",
    "constrain_hidden",
    "count_params",
    "families",
    "flops_per_token",
    "from_pretrained",
    "generate",
    "layout_for",
    "load_adapter",
    "lora_dropout",
    "make_apply_fn",
    "merge_lora",
    "pipeline_layout",
    "save_adapter",
    "save_pretrained",
    "transformer",
    "update_expert_bias",
]
