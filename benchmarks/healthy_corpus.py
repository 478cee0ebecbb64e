"""Realistic healthy training runs, trained the way practitioners train them: the rules must stay quiet on them.

Each entry of ``MODELS`` builds a small model and its data and trains it with the usual recipe of its kind
(AdamW with warmup and a cosine or linear schedule, bf16 autocast where the CPU supports it, gradient
clipping for language models, batch norm with step decay for a CNN, ...), calling ``attach(model, opt)``
for its probe. Transformer models are built from small configs of the ``transformers`` library, never
downloaded. benchmarks/healthy.py (every model x 3 seeds x 2 sampling intervals, real server) and
tests/test_healthy.py (a slice) both train from here, so the test and the figures measure the same runs.

Data is real and ships with what is installed:
- text: CPython's ``pydoc_data/topics.py``, the ~700 KB of English prose (with code) behind ``help()``,
  distributed with Python under the PSF License Version 2; tokenised with a 512-token byte-level BPE
  trained on it here by the ``tokenizers`` library (deterministic: the same ids on every run);
- images: scikit-learn's bundled handwritten digits (``load_digits``: 1,797 8x8 images, a copy of the UCI
  ML hand-written digits test set, shipped under scikit-learn's BSD-3-Clause licence).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Attach = Callable[[nn.Module, torch.optim.Optimizer], Any]  # attach(model, opt) -> a probe with step()/log()/close()


@dataclass(frozen=True)
class Model:
    name: str
    what: str
    train: Callable[[Attach, int], Result]  # train(attach, seed)


@dataclass
class Result:
    losses: list[float]
    val: list[tuple[int, float]]

    def median(self, lo: int, hi: int) -> float:
        xs = sorted(self.losses[lo:hi])
        return xs[len(xs) // 2]


def bf16_autocast() -> torch.autocast:
    """bf16 autocast on the CPU where its kernels support bf16 (AVX512-BF16 or AMX), else a no-op context."""
    try:
        ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        ok = False
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=ok)


# -- data ---------------------------------------------------------------------------------------------
VOCAB = 512
PAD, MASK, CLS = 0, 1, 2


@functools.lru_cache(maxsize=1)
def topic_tokens() -> dict[str, torch.Tensor]:
    """The ids of each of CPython's pydoc topics, under a BPE trained on all of them."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[PAD]", "[MASK]", "[CLS]"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    names = sorted(topics)
    tok.train_from_iterator([topics[k] for k in names], trainer)
    return {k: torch.tensor(tok.encode(topics[k]).ids, dtype=torch.long) for k in names}


def text_tokens() -> torch.Tensor:
    """All topics' ids, in name order."""
    return torch.cat(list(topic_tokens().values()))


def text_split(part: str) -> torch.Tensor:
    """'a' and 'b': the first and second halves of the text (pre-training and fine-tuning); 'train' and
    'val': the first 90% and the rest."""
    ids = text_tokens()
    cut = {"a": (0, len(ids) // 2), "b": (len(ids) // 2, len(ids)),
           "train": (0, len(ids) * 9 // 10), "val": (len(ids) * 9 // 10, len(ids))}[part]
    return ids[cut[0]:cut[1]]


def windows(ids: torch.Tensor, length: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Batches of ``batch`` windows of ``length`` tokens at random places in ``ids``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - length, (batch,), generator=g)
        yield torch.stack([ids[s:s + length] for s in starts])


def mask_tokens(x: torch.Tensor, g: torch.Generator, p: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: 15% of tokens are predicted; of those 80% become [MASK], 10% a random token, 10% stay."""
    labels = x.clone()
    chosen = torch.rand(x.shape, generator=g) < p
    labels[~chosen] = -100
    x = x.clone()
    r = torch.rand(x.shape, generator=g)
    x[chosen & (r < 0.8)] = MASK
    swap = chosen & (r >= 0.8) & (r < 0.9)
    x[swap] = torch.randint(CLS + 1, VOCAB, (int(swap.sum()),), generator=g)
    return x, labels


@functools.lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return (x - 0.3) / 0.4, torch.tensor(d.target)  # about zero mean, unit spread, as a transform would make it


def digit_split(seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    x, y = digits()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    return (x[:-300], y[:-300]), (x[-300:], y[-300:])


def shuffled(x: torch.Tensor, y: torch.Tensor, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1)
    while True:
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - batch + 1, batch):
            yield x[perm[i:i + batch]], y[perm[i:i + batch]]


# -- the training loop ----------------------------------------------------------------------------------
def train_loop(attach: Attach, model: nn.Module, opt: torch.optim.Optimizer, steps: int,
               step_loss: Callable[[], torch.Tensor], *, sched: Any = None, clip: float | None = None,
               accumulate: int = 1, evaluate: Callable[[], float] | None = None, eval_every: int = 100) -> Result:
    """One optimizer step per ``probe.step``: ``accumulate`` micro-batches, each ``step_loss()`` (forward
    and loss, under autocast where the recipe uses it), backward, optional clipping, the step, the schedule."""
    probe = attach(model, opt)
    result = Result([], [])
    try:
        model.train()
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for _ in range(accumulate):
                loss = step_loss()
                (loss / accumulate).backward()
                total += float(loss.detach()) / accumulate
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if sched is not None:
                sched.step()
            probe.step(loss=torch.tensor(total) if accumulate > 1 else loss)
            result.losses.append(total)
            if evaluate is not None and (step + 1) % eval_every == 0:
                model.eval()
                with torch.no_grad():
                    v = evaluate()
                model.train()
                result.val.append((step, v))
                probe.log(val_loss=v)
    finally:
        probe.close()
    return result


def quiet_transformers() -> None:
    """transformers' load reports, config notes and progress bars would bury what the benchmark prints."""
    from transformers.utils import logging
    logging.set_verbosity_error()
    logging.disable_progress_bar()


def warmup_cosine(opt: torch.optim.Optimizer, warmup: int, steps: int) -> Any:
    from transformers import get_cosine_schedule_with_warmup
    return get_cosine_schedule_with_warmup(opt, warmup, steps)


def warmup_linear(opt: torch.optim.Optimizer, warmup: int, steps: int) -> Any:
    from transformers import get_linear_schedule_with_warmup
    return get_linear_schedule_with_warmup(opt, warmup, steps)


def adamw(model: nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    """AdamW with no weight decay on biases and norm scales, as the Hugging Face and nanoGPT recipes do."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


# -- language models (transformers, small configs) -----------------------------------------------------------
SEQ = 32


def _lm_loss(model: nn.Module, batches: Iterator[torch.Tensor]) -> Callable[[], torch.Tensor]:
    def step_loss() -> torch.Tensor:
        x = next(batches)
        with bf16_autocast():
            return model(input_ids=x, labels=x).loss
    return step_loss


def _lm_eval(model: nn.Module, seed: int) -> Callable[[], float]:
    val = next(windows(text_split("val"), SEQ, 64, seed + 7))

    def evaluate() -> float:
        with bf16_autocast():
            return float(model(input_ids=val, labels=val).loss)
    return evaluate


def gpt2_model(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    quiet_transformers()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                      bos_token_id=PAD, eos_token_id=PAD))


def _causal_lm(attach: Attach, model: nn.Module, seed: int, steps: int) -> Result:
    """A decoder trained as one is pretrained: AdamW with weight decay, warmup then cosine, clip at 1."""
    opt = adamw(model, 3e-3, 0.1)
    return train_loop(attach, model, opt, steps, _lm_loss(model, windows(text_split("train"), SEQ, 16, seed)),
                      sched=warmup_cosine(opt, steps // 10, steps), clip=1.0, evaluate=_lm_eval(model, seed))


def gpt2(attach: Attach, seed: int, steps: int = 800) -> Result:
    return _causal_lm(attach, gpt2_model(seed), seed, steps)


def llama_model(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    quiet_transformers()
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD))


def llama(attach: Attach, seed: int, steps: int = 800) -> Result:
    return _causal_lm(attach, llama_model(seed), seed, steps)


def bert_model(seed: int) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    quiet_transformers()
    torch.manual_seed(seed)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=SEQ, pad_token_id=PAD))


def bert(attach: Attach, seed: int, steps: int = 800, model: nn.Module | None = None) -> Result:
    """Masked-LM pre-training of a tiny BERT on the text, linear warmup and decay."""
    model = model or bert_model(seed)
    opt = adamw(model, 2e-3)
    batches = windows(text_split("train"), SEQ, 16, seed)
    g = torch.Generator().manual_seed(seed + 3)

    def step_loss() -> torch.Tensor:
        x, labels = mask_tokens(next(batches), g)
        with bf16_autocast():
            return model(input_ids=x, labels=labels).loss
    return train_loop(attach, model, opt, steps, step_loss, sched=warmup_linear(opt, steps // 10, steps), clip=1.0)


def topic_windows(part: str, batch: int, seed: int, topics: int = 4) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of [CLS] and SEQ - 1 tokens at random places in the ``topics`` longest topics, labelled with
    their topic. Each topic is cut in blocks of 4 windows; every fifth block is 'val', the others 'train'."""
    by_topic = topic_tokens()
    names = sorted(by_topic, key=lambda k: (-len(by_topic[k]), k))[:topics]
    block = 4 * SEQ
    val = part == "val"
    parts = [torch.cat([ids[i:i + block] for i in range(0, len(ids), block) if (i // block % 5 == 4) == val])
             for ids in (by_topic[k] for k in names)]
    g = torch.Generator().manual_seed(seed)
    while True:
        y = torch.randint(0, topics, (batch,), generator=g)
        starts = [int(torch.randint(0, len(parts[t]) - SEQ, (1,), generator=g)) for t in y.tolist()]
        x = torch.stack([torch.cat([torch.tensor([CLS]), parts[t][s:s + SEQ - 1]]) for t, s in zip(y.tolist(), starts)])
        yield x, y


def bert_small_corpus(attach: Attach, seed: int, steps: int = 600, windows_: int = 32) -> Result:
    """Masked-LM training of the tiny BERT on a small corpus (32 windows of the text, each masked once, as the
    original BERT masked its data statically) for many epochs: it fits them, and its loss goes to ~1e-3."""
    model = bert_model(seed)
    opt = adamw(model, 3e-3)
    g = torch.Generator().manual_seed(seed + 3)
    x, labels = mask_tokens(next(windows(text_split("train"), SEQ, windows_, seed)), g)
    batches = shuffled(x, labels, 16, seed)

    def step_loss() -> torch.Tensor:
        xb, lb = next(batches)
        with bf16_autocast():
            return model(input_ids=xb, labels=lb).loss
    return train_loop(attach, model, opt, steps, step_loss, sched=warmup_linear(opt, steps // 10, steps), clip=1.0)


def bert_finetune(attach: Attach, seed: int, steps: int = 500) -> Result:
    """Fine-tuning a classifier from a checkpoint: the tiny BERT pre-trained by masked LM (without a probe),
    saved with ``save_pretrained``, loaded by ``BertForSequenceClassification.from_pretrained`` (a new head),
    then trained to tell which of 4 topics a window of text comes from, with a linear warmup and decay."""
    from transformers import BertForSequenceClassification
    with tempfile.TemporaryDirectory() as ckpt:
        pre = bert_model(seed)
        bert(lambda m, o: _NoProbe(), seed, steps=300, model=pre)
        pre.save_pretrained(ckpt)
        model = BertForSequenceClassification.from_pretrained(ckpt, num_labels=4)
    batches = topic_windows("train", 16, seed)
    vx, vy = next(topic_windows("val", 256, seed + 1))
    opt = adamw(model, 2e-3)

    def step_loss() -> torch.Tensor:
        xb, yb = next(batches)
        with bf16_autocast():
            return model(input_ids=xb, labels=yb).loss

    def evaluate() -> float:
        with bf16_autocast():
            return float(model(input_ids=vx, labels=vy).loss)
    return train_loop(attach, model, opt, steps, step_loss, sched=warmup_linear(opt, steps // 10, steps),
                      clip=1.0, evaluate=evaluate)


def gpt2_finetune(attach: Attach, seed: int, steps: int = 400) -> Result:
    """Fine-tuning: GPT-2 pre-trained (without a probe) on the first half of the text, saved with
    ``save_pretrained`` and loaded back with ``from_pretrained``, then trained on the second half at a
    10x lower learning rate with a short warmup."""
    from transformers import GPT2LMHeadModel
    pre = gpt2_model(seed)
    opt = adamw(pre, 3e-3, 0.1)
    pre_steps = 500
    train_loop(lambda m, o: _NoProbe(), pre, opt, pre_steps, _lm_loss(pre, windows(text_split("a"), SEQ, 16, seed)),
               sched=warmup_cosine(opt, pre_steps // 10, pre_steps), clip=1.0)
    with tempfile.TemporaryDirectory() as ckpt:
        pre.save_pretrained(ckpt)
        model = GPT2LMHeadModel.from_pretrained(ckpt)
    opt = adamw(model, 3e-4, 0.1)
    return train_loop(attach, model, opt, steps, _lm_loss(model, windows(text_split("b"), SEQ, 16, seed + 1)),
                      sched=warmup_linear(opt, steps // 20, steps), clip=1.0)


def llama_accumulate(attach: Attach, seed: int, steps: int = 300) -> Result:
    """Gradient accumulation: the Llama-style model at an effective batch of 32 made of 4 micro-batches of 8."""
    model = llama_model(seed)
    opt = adamw(model, 3e-3, 0.1)
    return train_loop(attach, model, opt, steps, _lm_loss(model, windows(text_split("train"), SEQ, 8, seed)),
                      sched=warmup_cosine(opt, steps // 10, steps), clip=1.0, accumulate=4)


class _NoProbe:
    def step(self, **_: Any) -> None: ...
    def log(self, **_: Any) -> None: ...
    def close(self) -> None: ...


# -- an LSTM language model ------------------------------------------------------------------------------
class LstmLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = 96, layers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, layers, batch_first=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.drop(self.embed(x)))
        return self.head(self.drop(h))


def lstm(attach: Attach, seed: int, steps: int = 800) -> Result:
    """A 2-layer LSTM language model, Adam with gradient clipping at 0.25 (the PyTorch word-language-model
    example's recipe), the learning rate divided by 4 two thirds of the way through."""
    torch.manual_seed(seed)
    model = LstmLM()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [steps * 2 // 3], gamma=0.25)
    batches = windows(text_split("train"), SEQ + 1, 16, seed)
    val = next(windows(text_split("val"), SEQ + 1, 64, seed + 7))

    def step_loss() -> torch.Tensor:
        x = next(batches)
        return nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    def evaluate() -> float:
        return float(nn.functional.cross_entropy(model(val[:, :-1]).reshape(-1, VOCAB), val[:, 1:].reshape(-1)))
    return train_loop(attach, model, opt, steps, step_loss, sched=sched, clip=0.25, evaluate=evaluate)


# -- vision -----------------------------------------------------------------------------------------------
def cnn_bn(attach: Attach, seed: int, steps: int = 800) -> Result:
    """A CNN with batch norm on the digits, SGD with momentum and weight decay, the learning rate divided by 10
    at 50% and 75% of the run (the ResNet recipe's step decay)."""
    torch.manual_seed(seed)
    (x, y), (vx, vy) = digit_split(seed)

    def block(i: int, o: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]
    model = nn.Sequential(*block(1, 16), *block(16, 16), nn.MaxPool2d(2), *block(16, 32), *block(32, 32),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4, 64), nn.BatchNorm1d(64), nn.ReLU(),
                          nn.Dropout(0.3), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [steps // 2, steps * 3 // 4], gamma=0.1)
    batches = shuffled(x, y, 32, seed)

    def step_loss() -> torch.Tensor:
        xb, yb = next(batches)
        return nn.functional.cross_entropy(model(xb), yb)
    return train_loop(attach, model, opt, steps, step_loss, sched=sched,
                      evaluate=lambda: float(nn.functional.cross_entropy(model(vx), vy)))


def vit(attach: Attach, seed: int, steps: int = 600) -> Result:
    """A ViT (transformers' ViTForImageClassification, 2x2 patches of the 8x8 digits), AdamW, warmup + cosine,
    label smoothing."""
    from transformers import ViTConfig, ViTForImageClassification
    quiet_transformers()
    torch.manual_seed(seed)
    (x, y), (vx, vy) = digit_split(seed)
    model = ViTForImageClassification(ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                                num_labels=10))
    opt = adamw(model, 2e-3, 0.05)
    batches = shuffled(x, y, 32, seed)

    def step_loss() -> torch.Tensor:
        xb, yb = next(batches)
        with bf16_autocast():
            logits = model(pixel_values=xb).logits
        return nn.functional.cross_entropy(logits.float(), yb, label_smoothing=0.1)

    def evaluate() -> float:
        with bf16_autocast():
            return float(nn.functional.cross_entropy(model(pixel_values=vx).logits.float(), vy))
    return train_loop(attach, model, opt, steps, step_loss, sched=warmup_cosine(opt, steps // 10, steps),
                      evaluate=evaluate)


# -- a run that learns late ----------------------------------------------------------------------------
def late_learner(attach: Attach, seed: int, steps: int = 2000) -> Result:
    """Sparse parity (the XOR of 4 of 32 random +-1 bits) learned by an MLP: the loss sits at ln 2 for
    500-700 steps while the network searches (no single bit correlates with the label), then drops to
    ~0 within 200 ("hidden progress", Barak et al., NeurIPS 2022)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    n, k = 32, 4
    model = nn.Sequential(nn.Linear(n, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def step_loss() -> torch.Tensor:
        x = torch.randint(0, 2, (64, n), generator=g).float() * 2 - 1
        y = (x[:, :k].prod(dim=1) > 0).float()
        return nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
    return train_loop(attach, model, opt, steps, step_loss)


MODELS: list[Model] = [
    Model("bert", "BertForMaskedLM (2x64), masked LM on the text, AdamW, linear warmup/decay, clip 1.0, bf16", bert),
    Model("bert_small_corpus", "the same BERT fitting 32 statically masked windows for 300 epochs: converges",
          bert_small_corpus),
    Model("gpt2", "GPT2LMHeadModel (2x64), causal LM, AdamW, warmup + cosine, clip 1.0, bf16, val_loss", gpt2),
    Model("llama", "LlamaForCausalLM (2x64, GQA), causal LM, AdamW, warmup + cosine, clip 1.0, bf16, val_loss", llama),
    Model("cnn_bn", "CNN with batch norm on digits, SGD momentum + wd, step decay, val_loss", cnn_bn),
    Model("vit", "ViTForImageClassification on digits, AdamW, warmup + cosine, label smoothing, bf16, val_loss", vit),
    Model("lstm", "2-layer LSTM language model, Adam, clip 0.25, lr step, val_loss", lstm),
    Model("late_learner", "MLP on sparse parity (4 of 32 bits): flat at ln 2, then a sharp drop", late_learner),
    Model("bert_finetune", "BERT fine-tuned from a masked-LM checkpoint to classify topics, val_loss", bert_finetune),
    Model("gpt2_finetune", "GPT-2 from a saved checkpoint, trained on new text at 10x lower lr", gpt2_finetune),
    Model("llama_accumulate", "Llama-style model, 4 micro-batches accumulated per optimizer step", llama_accumulate),
]
BY_NAME = {m.name: m for m in MODELS}
