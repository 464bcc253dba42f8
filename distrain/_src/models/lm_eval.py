"""lm-evaluation-harness through a strategy: :class:`LMEvalModel`.

:class:`LMEvalModel` is an lm-evaluation-harness model (``lm_eval.api.model.TemplateLM``)
whose forward passes run through ``strategy.run`` on the strategy it is given, with the
parameters in that strategy's layout (one device, replicas, FSDP, tensor parallelism).
lm-eval hands it every request of a task at once:

* ``loglikelihood`` / ``loglikelihood_rolling``: token windows, left-truncated to the
  model's context as lm-eval's own ``hf`` model truncates them (perplexity windows from
  ``lm_eval.utils.get_rolling_token_windows``), scored in batches of a few widths
  (``lm_eval_batches.py``);
* ``generate_until``: ``dt.models.generate`` (greedy, or sampled with the request's
  ``do_sample``/``temperature``/``top_k``/``top_p``), stopping a row at the end-of-text
  token and at any token whose text holds a stop string; the text is cut at the first
  stop string, as lm-eval's ``hf`` model cuts it.

Every process of a multi-process job runs the same requests (the strategy's programs
are collective); :meth:`LMEvalModel.evaluate` returns the results on process 0 only, and
``distrain lm-eval`` (``lm_eval_command.py``) writes them there only.

Text: the tokenizer of a Hugging Face directory (``tokenizer.json``, through
``tokenizers``) or bytes (the LM example's vocabulary of 256: token ``i`` is byte ``i``,
the end of text is byte 0, its document separator) (``lm_eval_text.py``).

Example:
  >>> lm = dt.models.LMEvalModel.from_pretrained("exported", strategy=strategy)
  >>> results = lm.evaluate(["hellaswag"], limit=100)  # lm_eval.simple_evaluate's kwargs
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import lm_eval.models  # noqa: F401  (lm-eval's own models, registered before ours)
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from distrain._src.current import get_strategy

# Importing a family's module registers it (from_pretrained finds families by name).
from distrain._src.models import gpt2 as _gpt2  # noqa: F401
from distrain._src.models import llama_family as _llama_family  # noqa: F401
from distrain._src.models import lm_eval_text as text
from distrain._src.models import mixtral as _mixtral  # noqa: F401
from distrain._src.models.hub import Pretrained
from distrain._src.models.hub import from_pretrained as _read_pretrained
from distrain._src.models.lm_eval_batches import Batches
from distrain._src.models.transformer_config import LMConfig

__all__ = ["LMEvalModel"]

_log = logging.getLogger(__name__)
#: What ``generate_until`` reads of a request's generation kwargs (others are refused).
_GEN_KEYS = frozenset(
    {"until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p"}
)


@register_model("distrain")
class LMEvalModel(TemplateLM):
    """A ``dt.models`` language model as an lm-evaluation-harness model (see the module
    docstring). Build it with :meth:`from_pretrained` or :meth:`from_checkpoint`, or
    from a module and its parameters.

    Args:
      model: a ``dt.models.Pretrained``, or a module (``dt.models.Transformer``, ``Llama``,
        ``Mixtral``, with LoRA adapters or not).
      params: its parameters (``nnx.State`` or pure dict) in ``strategy``'s layout
        (default: the ``Pretrained``'s, or the module's own).
      tokenizer: ``"bytes"``, a ``tokenizers.Tokenizer`` (default: the ``Pretrained``'s
        ``tokenizer.json``; bytes for a vocabulary of 256).
      strategy: where the forward passes run (default ``dt.get_strategy()``).
      batch_size: rows per forward pass or generation batch, rounded up to a multiple of
        the strategy's devices.
      max_gen_toks: new tokens at most when a request does not say (lm-eval's 256).
      eot_token, bos_token: ids of the end-of-text and beginning-of-sequence tokens
        (default: ``config.json``'s, else ``tokenizer_config.json``'s; bytes: 0 and none).
      seed: the key of sampled generations.

    Example:
      >>> lm = dt.models.LMEvalModel(model, state.params, "bytes", strategy=strategy)
      >>> lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai"])
    """

    def __init__(self, model: Any, params: Any = None, tokenizer: Any = None, *,
                 strategy: Any = None, batch_size: int = 16, max_gen_toks: int = 256,
                 eot_token: int | None = None, bos_token: int | None = None,
                 seed: int = 1234) -> None:  # fmt: skip
        super().__init__()
        self.model = model
        self.strategy = strategy if strategy is not None else get_strategy()
        if isinstance(model, Pretrained):
            graphdef, cfg = model.graphdef, model.config
            params = model.params if params is None else params
            tokenizer = model.tokenizer if tokenizer is None else tokenizer
            special = text.special_tokens(model.hf_config, model.directory, tokenizer)
        elif isinstance(model, nnx.Module):
            graphdef, cfg = nnx.graphdef(model), getattr(model, "cfg", None)
            params = nnx.state(model) if params is None else params
            special = (None, None)
        else:
            raise TypeError(
                "LMEvalModel's model must be a dt.models.Pretrained or a dt.models module "
                f"(Transformer, Llama, Mixtral). Received: {type(model).__name__}."
            )
        self.context = _context(cfg)
        self.params = params
        self.text = text.wrap(tokenizer, cfg.vocab_size)
        eot = eot_token if eot_token is not None else special[1]
        self.eot = _check_id("eot_token", eot if eot is not None else self.text.default_eot, cfg)
        bos = bos_token if bos_token is not None else special[0]
        self.bos = None if bos is None else _check_id("bos_token", bos, cfg)
        self.batches = Batches(self.strategy, graphdef, self.context,
                               _check_int("batch_size", batch_size))  # fmt: skip
        self.max_gen_toks = _check_int("max_gen_toks", max_gen_toks)
        self.seed = seed
        self._stops: dict[tuple[str, ...], tuple[int, ...]] = {}

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_pretrained(cls, path: str, *, strategy: Any = None, dtype: Any = None,
                        **kwargs: Any) -> LMEvalModel:  # fmt: skip
        """The model of a Hugging Face directory (``dt.models.from_pretrained``), read
        into ``strategy``'s layout, with its ``tokenizer.json``. ``kwargs``: the class's."""
        strategy = strategy if strategy is not None else get_strategy()
        return cls(_read_pretrained(path, strategy=strategy, dtype=dtype), strategy=strategy,
                   **kwargs)  # fmt: skip

    @classmethod
    def from_checkpoint(cls, config: str, checkpoint: str, *, step: int | None = None,
                        overrides: Sequence[str] = (), strategy: Any = None,
                        tokenizer: Any = None, **kwargs: Any) -> LMEvalModel:  # fmt: skip
        """The model of a run: its config's ``model.fn`` and the parameters of the newest
        (or ``step``) checkpoint in ``checkpoint``, as ``distrain export`` reads them,
        placed by ``strategy`` (default: the one the config names).
        ``tokenizer``: ``"bytes"`` (the default for a vocabulary of 256), a
        ``tokenizers.Tokenizer`` or the path of a ``tokenizer.json``."""
        from distrain._src.models.run_reader import read_run

        module, params, strategy = read_run(config, checkpoint, step, overrides, strategy)
        if isinstance(tokenizer, str) and tokenizer != "bytes":
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(tokenizer)
        return cls(module, params, tokenizer, strategy=strategy, **kwargs)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> LMEvalModel:
        """lm-eval's constructor (``--model distrain --model_args ...``): ``pretrained=DIR``,
        or ``config=FILE,checkpoint=DIR[,step=N][,tokenizer=bytes|FILE]``; ``--batch_size``
        an int (``auto``: the default)."""
        args = dict(arg_dict)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        # lm-eval's --device (its default is "cuda") names a PyTorch device: the strategy
        # places this model, on its own devices.
        extra.pop("device", None)
        extra.pop("max_batch_size", None)
        size = extra.pop("batch_size", None)
        if size is not None and not str(size).startswith("auto"):
            args["batch_size"] = int(size)
        built = args.pop("built", None)
        if built is not None:  # `distrain lm-eval` built it (and reported its errors)
            lm = _BUILT[built]
            unknown = sorted(set(args) - {"batch_size"})
            if unknown:
                raise ValueError(
                    f"distrain lm-eval builds the model from its own flags: lm-eval's "
                    f"--model_args {unknown} would be ignored. Drop them."
                )
            lm.batch_size = args.get("batch_size", lm.batch_size)
            return lm
        if "pretrained" in args:
            return cls.from_pretrained(args.pop("pretrained"), **args)
        if "config" in args and "checkpoint" in args:
            return cls.from_checkpoint(args.pop("config"), args.pop("checkpoint"), **args)
        raise ValueError(
            "distrain's lm-eval model needs model_args pretrained=HF_DIR, or config=FILE and "
            f"checkpoint=DIR. Received: {sorted(arg_dict)}."
        )

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> LMEvalModel:
        """``create_from_arg_obj`` of ``"key=value,key=value"``."""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string),
                                       additional_config)  # fmt: skip

    # ---------------------------------------------------------------- evaluation

    def evaluate(
        self,
        tasks: Sequence[str],
        *,
        params: Any = None,
        include_path: str | None = None,
        **kwargs: Any,
    ) -> dict[str, Any] | None:
        """``lm_eval.simple_evaluate(model=self, tasks=tasks, **kwargs)``, on ``params``
        for this call when given (a state's during ``fit``); ``include_path``: a directory
        of task YAML files of your own. Every process must call it; the results are
        returned on process 0, ``None`` elsewhere."""
        import lm_eval
        from lm_eval.tasks import TaskManager

        if "task_manager" not in kwargs:
            kwargs["task_manager"] = TaskManager(include_path=include_path)
        kept = self.params
        self.params = self.params if params is None else params
        try:
            results = lm_eval.simple_evaluate(model=self, tasks=list(tasks), **kwargs)
        finally:
            self.params = kept
        return results if jax.process_index() == 0 else None

    @property
    def batch_size(self) -> int:
        """Rows per forward pass or generation batch (before rounding to the devices)."""
        return self.batches.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.batches.batch_size = _check_int("batch_size", value)

    # ---------------------------------------------------------------- lm-eval's interface

    @property
    def eot_token_id(self) -> int:
        return int(self.eot)

    @property
    def prefix_token_id(self) -> int:
        # What an empty context conditions on: BOS where the model has one (lm-eval's hf).
        return int(self.bos if self.bos is not None else self.eot)

    @property
    def max_length(self) -> int:
        return self.context

    @property
    def tokenizer_name(self) -> str:
        return self.text.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:  # fmt: skip
        if add_special_tokens is None:
            # A string that starts with the BOS text gets no second one (as lm-eval's hf).
            bos = None if self.bos is None else self.text.decode([self.bos], False)
            add_special_tokens = not (bos and string.startswith(bos))
        return self.text.encode(string, add_special_tokens)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.text.decode(list(tokens), skip_special_tokens)

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:  # fmt: skip
        windows = []
        for _, context, continuation in requests:
            if len(continuation) > self.context:
                raise ValueError(
                    f"A continuation of {len(continuation)} tokens is longer than the "
                    f"model's context of {self.context}: it cannot be scored. Shorten it."
                )
            whole = (list(context) + list(continuation))[-(self.context + 1) :]
            if len(context) + len(continuation) > self.context + 1:
                _log.warning("A request of %d tokens is left-truncated to the context of %d.",
                             len(context) + len(continuation), self.context)  # fmt: skip
            windows.append((whole[:-1], whole[1:], len(continuation)))
        answers = self.batches.score(self.params, windows)
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        owners, windows = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            pairs = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.context, context_len=1,
            )  # fmt: skip
            for context, predicted in map(lm_utils.make_disjoint_window, pairs):
                whole = list(context) + list(predicted)
                windows.append((whole[:-1], whole[1:], len(predicted)))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owners, self.batches.score(self.params, windows), strict=True):
            totals[i] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # one generation setting per batch
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for indices in groups.values():
            kwargs = requests[indices[0]].args[1]
            contexts = [requests[i].args[0] for i in indices]
            for i, s in zip(indices, self._generate(contexts, kwargs), strict=True):
                out[i] = s
                self.cache_hook.add_partial("generate_until", requests[i].args, s)
        return out

    # ---------------------------------------------------------------- generation

    def _generate(self, contexts: list[str], kwargs: dict[str, Any]) -> list[str]:
        """Greedy (or sampled) continuations of ``contexts``, cut at the stop strings."""
        unknown = sorted(set(kwargs) - _GEN_KEYS)
        if unknown:
            raise ValueError(
                f"distrain's lm-eval model does not implement the generation kwargs "
                f"{unknown}; it reads {sorted(_GEN_KEYS)}."
            )
        n = int(kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", self.max_gen_toks)))
        if n >= self.context:
            raise ValueError(
                f"max_gen_toks={n} leaves no room for a prompt in the model's context of "
                f"{self.context} tokens: give the task (or LMEvalModel) a smaller max_gen_toks."
            )
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        eos = self.tok_decode([self.eot], skip_special_tokens=False)
        until += [eos] if eos and eos not in until else []  # as lm-eval's hf model
        options: dict[str, Any] = {"stop_tokens": self._stop_tokens(tuple(until))}
        temperature = float(kwargs.get("temperature", 1.0))
        if kwargs.get("do_sample", False) and temperature > 0:
            options.update(temperature=temperature, top_k=kwargs.get("top_k"),
                           top_p=kwargs.get("top_p"), rng=jax.random.key(self.seed))  # fmt: skip
        # Left-truncated to leave room for n new tokens (lm-eval's hf model does the same).
        prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-(self.context - n) :]
                   for c in contexts]  # fmt: skip
        texts = []
        for tokens in self.batches.generate(self.model, self.params, prompts, n, **options):
            s = self.tok_decode(tokens)
            for term in until:  # lm-eval's cut: before the first of any stop string
                s = s.split(term)[0] if term else s
            texts.append(s)
        return texts

    def _stop_tokens(self, until: tuple[str, ...]) -> tuple[int, ...]:
        """The end-of-text token and every token whose own text holds a stop string: a
        row that emits one has reached its cut, so it can stop there (a stop string split
        over tokens is still cut from the text, after more steps)."""
        if until not in self._stops:
            pieces = self.text.pieces()
            hits = {t for t, s in enumerate(pieces) if any(u and u in s for u in until)}
            self._stops[until] = tuple(sorted(hits | {self.eot}))
        return self._stops[until]


#: Models ``distrain lm-eval`` built, by the handle it passes as ``model_args built=N``.
_BUILT: dict[int, LMEvalModel] = {}


def _context(cfg: Any) -> int:
    if isinstance(cfg, LMConfig):
        if cfg.pipeline_microbatches is not None:
            raise ValueError(
                "LMEvalModel runs a model whose blocks are a list; this LMConfig stacks them "
                "for dt.nn.pipeline. Export it (dt.models.save_pretrained) and import it back."
            )
        return cfg.seq_len
    context = getattr(cfg, "max_position_embeddings", None)
    if context is None:
        raise TypeError(
            "LMEvalModel's module must be a dt.models Transformer, Llama or Mixtral (a "
            f"config with seq_len or max_position_embeddings). Received config {cfg!r}."
        )
    return int(context)


def _check_id(name: str, value: int | None, cfg: Any) -> int:
    if value is None:
        raise ValueError(
            "LMEvalModel needs the end-of-text token id, and neither config.json's "
            "eos_token_id nor tokenizer_config.json's eos_token gives it: pass eot_token=."
        )
    if not 0 <= value < cfg.vocab_size:
        raise ValueError(
            f"{name}={value} is outside the model's vocabulary of {cfg.vocab_size} (from "
            f"the checkpoint's config?): pass {name}= an id below {cfg.vocab_size}."
        )
    return int(value)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"LMEvalModel's {name} must be an int >= 1. Received: {value!r}.")
    return int(value)
