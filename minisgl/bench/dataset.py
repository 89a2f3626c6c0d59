"""Random prompts of a chosen length, in sglang bench_serving's "random" style.

With a tokenizer (--tokenizer, a tokenizer.json or a model directory holding one) a prompt is
random token ids of the sampled length, decoded to text, so the server sees about that many
tokens (re-encoding decoded text can merge or split a few). Without one, a prompt is that many
random common English words, which byte-level BPE tokenizers such as Qwen's encode as about one
token each. Either way the reported input throughput uses the server's own usage counts when the
server reports them.
"""

import random
from dataclasses import dataclass
from pathlib import Path

# Short, common words: each is a single token for GPT-style and Qwen tokenizers.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his are be this have an which "
    "or not had but were their they one all there has been more would who its when some time "
    "new people also only other over first two may after into most could years made these "
    "city year where such many can then used each well about up out world state work end "
    "house group life day game part water war team name three best way long high early small "
    "great main book line place body home land field light power food road music film"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # intended prompt tokens (the server's usage, when reported, wins)
    output_len: int


def sample_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """n lengths uniform in [length * range_ratio, length] (sglang's --random-range-ratio)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    high = max(low, length)
    return [rng.randint(low, high) for _ in range(n)]


class _TokenizerText:
    """Text of n random tokens through a local tokenizers.Tokenizer."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tokenizer = Tokenizer.from_file(str(file))
        # Only ordinary tokens: special tokens would change how the server treats the prompt.
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.added = set(self.tokenizer.get_added_tokens_decoder())
        if len(self.added) >= self.vocab:
            raise ValueError(f"tokenizer at {path} has no ordinary tokens")

    def _token(self, rng: random.Random) -> int:
        while True:
            token = rng.randrange(self.vocab)
            if token not in self.added:
                return token

    def text(self, rng: random.Random, n: int) -> str:
        ids = [self._token(rng) for _ in range(n)]
        text = self.tokenizer.decode(ids)
        # One re-encode pass pulls the length back toward n after decode merged tokens.
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids[:n]
        return self.tokenizer.decode(ids)


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    tokenizer: str | None = None,
) -> list[BenchRequest]:
    """The same arguments give the same prompts (so peers are compared on equal work)."""
    rng = random.Random(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    source = _TokenizerText(tokenizer) if tokenizer else None
    requests = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        if source is not None:
            prompt = source.text(rng, n_in)
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
        requests.append(BenchRequest(prompt, n_in, n_out))
    return requests
