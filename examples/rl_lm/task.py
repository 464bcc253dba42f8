"""The task: reverse a string of distinct letters, written as text, with a checkable answer.

A prompt is the string and a separator, ``"cfad>"``; the right completion is the string
reversed and the stop token, ``"dafc."``. Strings have 3 to 5 distinct letters of
``a``-``h`` (8,736 of them); a fixed tenth is held out, and held-out strings appear
neither in pretraining nor in RL.

* **Pretraining text** (:func:`pretrain_rows`) has the format right and the answer
  wrong: a *shuffle* of the prompt's letters that is never the reversal. The model
  learns to answer with the prompt's letters in some order, which makes the reversal a
  likely sample (one order of ``L!``) while greedy decoding almost never writes it.
* **Reward** (:func:`reward`): partial credit, the fraction of the ``L`` answer
  positions that hold the right letter, and 0 when the completion is not ``L`` letters
  and the stop token (a wrong length earns nothing). A completion is *correct* when its
  reward is 1.

Tokens: ``0`` is ``"."`` (stop, and padding), ``1`` is ``">"``, ``2..9`` are ``a..h``.

Example:
    >>> split = make_split(seed=0)
    >>> decode(split.train["prompt"][0][: split.train["length"][0] + 1])
    'baedc>'
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

STOP, SEP = 0, 1
LETTERS = "abcdefgh"
VOCAB = 2 + len(LETTERS)
MIN_LEN, MAX_LEN = 3, 5
PROMPT_WIDTH = MAX_LEN + 1  # letters and the separator
ANSWER_WIDTH = MAX_LEN + 1  # letters and the stop token: generate's max_new_tokens
SEQ_WIDTH = PROMPT_WIDTH + ANSWER_WIDTH


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (letters, ``>`` and ``.``)."""
    table = {".": STOP, ">": SEP, **{c: 2 + i for i, c in enumerate(LETTERS)}}
    return [table[c] for c in text]


def decode(tokens: np.ndarray | list[int]) -> str:
    """The text of token ids (the inverse of :func:`encode`)."""
    return "".join(".>"[t] if t < 2 else LETTERS[t - 2] for t in np.asarray(tokens).tolist())


@dataclasses.dataclass(frozen=True)
class Split:
    """Prompts as arrays, ``train`` for pretraining and RL, ``held_out`` for evaluation.

    Each is a dict of ``prompt`` ``[N, PROMPT_WIDTH]`` (letters, separator, then STOP
    padding), ``length`` ``[N]`` (letters, ``L``) and ``target`` ``[N, ANSWER_WIDTH]``
    (the reversal, then STOP).
    """

    train: dict[str, np.ndarray]
    held_out: dict[str, np.ndarray]


def all_strings() -> list[tuple[int, ...]]:
    """Every string of MIN_LEN..MAX_LEN distinct letters, as letter indices."""
    return [
        p
        for n in range(MIN_LEN, MAX_LEN + 1)
        for p in itertools.permutations(range(len(LETTERS)), n)
    ]


def _arrays(strings: list[tuple[int, ...]]) -> dict[str, np.ndarray]:
    n = len(strings)
    prompt = np.full((n, PROMPT_WIDTH), STOP, np.int32)
    target = np.full((n, ANSWER_WIDTH), STOP, np.int32)
    length = np.array([len(s) for s in strings], np.int32)
    for i, s in enumerate(strings):
        letters = np.asarray(s, np.int32) + 2
        prompt[i, : len(s)] = letters
        prompt[i, len(s)] = SEP
        target[i, : len(s)] = letters[::-1]
    return {"prompt": prompt, "length": length, "target": target}


def make_split(seed: int = 0, held_out_fraction: float = 0.1) -> Split:
    """Shuffles every string with ``seed`` and holds out ``held_out_fraction`` of them."""
    strings = all_strings()
    order = np.random.default_rng(seed).permutation(len(strings))
    cut = int(round(len(strings) * held_out_fraction))
    held = [strings[i] for i in order[:cut]]
    train = [strings[i] for i in order[cut:]]
    return Split(train=_arrays(train), held_out=_arrays(held))


def pretrain_rows(data: dict[str, np.ndarray], seed: int) -> np.ndarray:
    """One text per prompt, the format with a wrong answer: ``"cfad>" + shuffle + "."``.

    The shuffle is a uniformly drawn order of the prompt's letters other than the
    reversal (the letters are distinct, so the reversal is one order of ``L!``).

    Returns:
        ``[N, SEQ_WIDTH]`` int32 rows: prompt, answer, stop, then STOP padding.
    """
    rng = np.random.default_rng(seed)
    n = len(data["length"])
    rows = np.full((n, SEQ_WIDTH), STOP, np.int32)
    for i in range(n):
        length = int(data["length"][i])
        letters = data["prompt"][i, :length]
        answer = letters[::-1]
        while np.array_equal(answer, letters[::-1]):
            answer = rng.permutation(letters)
        rows[i, : length + 1] = data["prompt"][i, : length + 1]
        rows[i, length + 1 : 2 * length + 1] = answer
    return rows


def reward(
    completion: jax.Array, completion_length: jax.Array, target: jax.Array, length: jax.Array
) -> jax.Array:
    """Partial credit for each completion: right letters in place / ``L``, 0 if malformed.

    Args:
        completion: ``[B, ANSWER_WIDTH]`` generated tokens (``dt.models.generate``'s).
        completion_length: ``[B]`` tokens generated, the stop token included.
        target: ``[B, ANSWER_WIDTH]`` the reversal then STOP.
        length: ``[B]`` letters in the prompt, ``L``.

    Returns:
        ``[B]`` float32 in ``[0, 1]``; 1 exactly when the completion is the reversal
        followed by the stop token.
    """
    cols = jnp.arange(completion.shape[1])[None]
    in_answer = cols < length[:, None]
    right = jnp.sum((completion == target) & in_answer, axis=1)
    # Well formed: the first stop token is at position L (generate's length counts it;
    # a row that never stopped has the full width, hence the explicit check).
    stop_at_l = jnp.take_along_axis(completion, length[:, None], axis=1)[:, 0] == STOP
    well_formed = (completion_length == length + 1) & stop_at_l
    return jnp.where(well_formed, right / length, 0.0).astype(jnp.float32)
