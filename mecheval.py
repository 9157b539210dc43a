"""
mecheval: mechanistic evaluation of Transformers and state space models, in one readable file.

A minimal PyTorch reimplementation of A. Arora, N. Rathi, N. Selvam, R. Csordás, D. Jurafsky, C. Potts,
"Mechanistic evaluation of Transformers and state space models" (arXiv 2505.15105). The paper trains tiny
2-layer models on two recall tasks and asks not only *whether* they recall but *how*: by induction (the
key is carried onto its value token, where the query finds it) or by direct retrieval (at the query).

    python mecheval.py --arch based --task ar        # the paper's AR at d=64, then its mechanism
    python mecheval.py --load runs/ar_based_d64_l2_lr0.001_s0 --analyze    # re-evaluate a saved run

Reading order: settings -> tasks (AR, ATR) -> one whole model, attention its mixer -> training -> interchange
interventions and the verdict (a first read may stop there) -> the other mixers, a catalogue -> machinery: the
Config, run folders, sweeps and presets, command line. kernels.py holds the fast forms of the expensive sequence
operations, each beside its plain definition.

Words: a document's named positions are key, value, next_key (the following pair's key), divider (the EOS
before the query) and query; a site is an activation a hook reads or replaces (block_input, conv_output, ...);
an attribution is the share of p(answer) that patching one clean activation into a run whose key was corrupted
brings back. Letters, one meaning each: B batch, L sequence length, d model width, V vocabulary, M documents in
a split, P key-value pairs of an AR document, E inner channels of Mamba (2d), N state size of an SSM, H heads of H3.
The SSM parameters keep the papers' names A, B, C, D and Δ; they are tensors, not sizes. u is a mixer's
input, h a convolution filter, and * causal convolution over time: (h * u)_t = Σ_{s<=t} h_{t-s} u_s.
"""
import argparse
import functools
import json
import math
import numbers
import os
import random
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

# ----------------------------------------------------------------------------------------------------
# Settings: the paper's. A run's Config (machinery) checks each, fills in lr=0 and steps=0, and names the run.

PAD, BOS, EOS = 0, 1, 2   # special tokens shared by both tasks
MAX_LEN = 1024            # longest document (the paper's l_max and position-table size)
TASKS = ("ar", "atr")
ATR_SETTINGS = {"easy": (4, 20), "medium": (9, 20), "8192": (4, 8192)}  # (longest rule body, terminals)
PAPER_STEPS = {"ar": 50_016, "atr": 100_032}  # AR 16 epochs, ATR 32 epochs of 100,032 docs at B=32
ARCHS = {}       # name -> mixer class; filled by @register in the mixer section
DEFAULT_LR = {}  # name -> default peak learning rate


class ConfigError(ValueError):
    """A setting that cannot work; the message is one sentence naming the value and what is allowed."""


def setting(default, help):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Settings:
    # the task
    task: str = setting("ar", "task: ar (associative recall) or atr (associative treecall)")
    n_pairs: int = setting(16, "AR: key-value pairs per document (length 2P+5)")
    n_keys: int = setting(4096, "AR: number of key tokens")
    n_values: int = setting(4096, "AR: number of value tokens")
    atr_setting: str = setting("easy", "ATR grammar (longest rule body, terminals): easy, medium or 8192")
    atr_split: str = setting("iid", "ATR: iid, or gen: (parent, child) pairs held out of training, tested apart")
    atr_heldout: float = setting(0.2, "ATR generalisation split: fraction of (parent, child) pairs held out")
    atr_query: str = setting("parent", "ATR: the child's parent, inner (a parent not the root) or sibling (App. D.4)")
    n_train: int = setting(100_032, "training documents (iterated in epochs)")
    n_eval: int = setting(320, "evaluation documents")
    # the model
    arch: str = setting("attention", "sequence mixer (see the mixer section)")
    d_model: int = setting(64, "model width d")
    n_layers: int = setting(2, "number of residual blocks")
    pos_emb: str = setting("auto", "learned absolute positions: auto (attention only, as the paper), on, off")
    d_conv: str = setting("auto", "short-conv width: N, 0 = none (mamba, deltanet), or long (based, base_conv)")
    # training, as the paper (AdamW, warm-up then cosine)
    lr: float = setting(0.0, "peak learning rate; 0 = the architecture's measured default")
    beta2: float = setting(0.999, "AdamW's beta2: the paper's 0.999, or e.g. 0.95")
    steps: int = setting(0, "optimiser steps; 0 = the paper's schedule (AR 50,016, ATR 100,032)")
    batch_size: int = setting(32, "documents per step")
    warmup: float = setting(0.1, "fraction of the steps spent in linear warm-up")
    seed: int = setting(0, "seeds the data, the grammar, the initialisation and the batch order")
    batch_order: str = setting("shuffle", "shuffle: a new order each epoch; fixed: the authors' one, every epoch")
    eval_every: int = setting(250, "steps between evaluations, progress lines and checkpoints")
    target_acc: float = setting(0.99, "stop once eval accuracy reaches this; 0 trains the whole schedule")
    # the mechanism analysis
    analyze: bool = setting(True, "run the interchange-intervention grid after training, or with --load")
    analyze_every: int = setting(2000, "steps between checks of the mechanism in training (watch); 0 = none")
    corrupt: str = setting("key", "context token the analysis corrupts: key (the paper's) or value")
    # where it runs
    device: str = setting("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    compile: bool = setting(False, "torch.compile the training step (CUDA graphs on CUDA)")


# ----------------------------------------------------------------------------------------------------
# Tasks. Both produce fixed splits of padded documents with one trained prediction each: at the query
# position the model must output the answer, the next token; the loss is read there and nowhere else.
# The named positions, where the analysis corrupts and patches:
#     name       AR (make_ar)                  ATR (make_atr_split)
#     key        the queried pair's key        the queried child, in the sentence
#     value      its value, right after it     the child's parent, to its right (often the next token)
#     next_key   the next pair's key           the token after the child (key + 1)
#     divider    the EOS before the query      the EOS before the query
#     query      the key, asked again          the child, asked again
# With --atr_query sibling, value is the child's rightmost sibling, the answer (none if the child answers).

@dataclass
class Split:
    input_ids: torch.Tensor  # (M, L) token ids, PAD-padded on the right
    pos: dict                # name -> (M,) positions: key, value, next_key, divider, query, answer
    lengths: torch.Tensor    # (M,) document lengths before padding
    vocab_size: int = 0      # its task's number of tokens (0: not known)

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, rows):  # split[:n], its first n documents
        return Split(self.input_ids[rows], {k: p[rows] for k, p in self.pos.items()}, self.lengths[rows],
                     self.vocab_size)

    @property
    def answers(self):
        return self.input_ids.gather(1, self.pos["answer"][:, None])[:, 0]  # (M,)


@dataclass
class Task:
    name: str
    vocab_size: int
    train: Split
    eval: Split
    classes: dict            # "key" / "value" -> (lo, hi): the ids [lo, hi) of the tokens that can stand there
                             # (AR: keys, values; ATR: terminals); a corrupted token is drawn from them
    heldout: object = None   # ATR generalisation split: (|Σ|, |Σ|) bool, True = held-out (parent, child)
    test: Split = None       # ATR generalisation split: the test documents (queries on held-out pairs)
    query: str = "parent"    # ATR: the child's parent (parent, inner) or sibling (AR: parent)

    def __post_init__(self):  # its splits know their vocabulary
        for split in filter(None, (self.train, self.eval, self.test)):
            split.vocab_size = split.vocab_size or self.vocab_size


def make_split(docs, pos):
    """A Split of documents (an (M, L) array, or token lists padded here) and their named positions
    (name -> one position per document; the answer is the token after the query)."""
    if isinstance(docs, np.ndarray):  # documents of one length
        ids, lengths = torch.from_numpy(docs), torch.full((len(docs),), docs.shape[1])
    else:
        lengths = torch.tensor([len(d) for d in docs])
        ids = nn.utils.rnn.pad_sequence([torch.tensor(d) for d in docs], batch_first=True, padding_value=PAD)
    pos = {k: torch.as_tensor(np.asarray(v), dtype=torch.long) for k, v in pos.items()}
    return Split(ids, pos, lengths)


def sample_distinct(rng, n, k, high):
    """(n, k) integers in [0, high), distinct within each row, each row uniform over ordered k-tuples."""
    if k * k <= high:  # rejection: a row has a repeat with probability < 1/2, redraw those rows
        out = rng.integers(0, high, (n, k))
        while True:
            s = np.sort(out, axis=1)
            bad = (s[:, 1:] == s[:, :-1]).any(axis=1)
            if not bad.any():
                return out
            out[bad] = rng.integers(0, high, (int(bad.sum()), k))
    chunks = [rng.random((min(4096, n - i), high)).argsort(axis=1)[:, :k] for i in range(0, n, 4096)]
    return np.concatenate(chunks) if chunks else np.zeros((0, k), dtype=np.int64)


def make_ar(cfg, n, rng):
    """Associative recall (the paper's AR, as aryamanarora/tinylang). A document with P=3 pairs (the paper: 16):

        position  0    1   2    3   4    5   6    7    8    9   10
        token     BOS  k7  v40  k2  v9   k5  v11  EOS  k2   v9  EOS
        label     -    -   -    -   -    -   -    -    v9   -   -

    Keys k0.. are ids 3..3+n_keys-1, values v0.. follow them. Each document draws P distinct keys and P
    distinct values, pairs them in order, and queries one key chosen uniformly; only the prediction at
    the query position (8) is trained. Named positions for the queried pair i (here i=1): key 1+2i=3,
    value 2+2i=4, next_key 3+2i=5 (the following pair's key; -1 when i is the last pair), divider 2P+1=7,
    query 2P+2=8, answer 2P+3=9.
    """
    P = cfg.n_pairs
    keys = sample_distinct(rng, n, P, cfg.n_keys) + 3                      # (M, P) key ids
    vals = sample_distinct(rng, n, P, cfg.n_values) + 3 + cfg.n_keys      # (M, P) value ids
    i = rng.integers(0, P, n)                                     # (M,) the queried pair
    rows = np.arange(n)
    pairs = np.stack([keys, vals], axis=2).reshape(n, 2 * P)     # (M, 2P): k v k v ...
    bos, eos = np.full(n, BOS), np.full(n, EOS)
    ids = np.column_stack([bos, pairs, eos, keys[rows, i], vals[rows, i], eos])   # (M, 2P+5)
    pos = {"key": 1 + 2 * i, "value": 2 + 2 * i, "next_key": np.where(i < P - 1, 3 + 2 * i, -1),
           "divider": np.full(n, 2 * P + 1), "query": np.full(n, 2 * P + 2), "answer": np.full(n, 2 * P + 3)}
    return make_split(ids, pos)


class Grammar:
    """The random right-headed PCFG behind associative treecall, the paper's new task (tinylang's grammar).

    40 nonterminals, each with a random depth score in 1..10; a rule for X uses only nonterminals of larger score,
    so there is no recursion. Each X has 1..5 rules (bodies of 1..max_body symbols; tinylang's max_rhs, an exclusive
    bound, is max_body + 1), each symbol a nonterminal or, with weight 20, a terminal chosen when the rule is made.
    Expanding X writes its body's expansions, then a head terminal drawn from X's own distribution as the rightmost
    symbol; that head is the parent of everything X produced directly (terminals, and child nonterminals' heads).
    """

    def __init__(self, rng, n_terminals, max_body, n_nonterminals=40, max_depth=10, max_rules=5,
                 terminal_weight=20):
        self.n_terminals = n_terminals
        depth = rng.integers(1, max_depth + 1, n_nonterminals)
        self.rules, self.rule_cum, self.head_cum = [], [], []
        for x in range(n_nonterminals):
            allowed = [y for y in range(n_nonterminals) if depth[y] > depth[x]]
            p_terminal = terminal_weight / (terminal_weight + len(allowed))

            def symbol():  # a terminal t >= 0, or a nonterminal y stored as -(y + 1)
                if rng.random() < p_terminal:
                    return int(rng.integers(n_terminals))
                return -(allowed[rng.integers(len(allowed))] + 1)
            n_rules = rng.integers(1, max_rules + 1)
            bodies = [[symbol() for _ in range(rng.integers(1, max_body + 1))] for _ in range(n_rules)]
            self.rules.append(bodies)
            self.rule_cum.append(np.cumsum(rng.dirichlet(np.ones(len(bodies)))).tolist())
            self.head_cum.append(np.cumsum(rng.dirichlet(np.ones(n_terminals))).tolist())

    def sample(self, draw, max_tokens):
        """One sentence from a uniform start symbol, drawn with draw (a random.Random): (terminals, parent position
        or -1 for the root). Returns None once it grows past max_tokens."""
        tokens, parents = [], []

        def emit(t):  # writes terminal t, returns its position; past max_tokens the sentence is dropped
            tokens.append(t)
            parents.append(-1)
            if len(tokens) > max_tokens:
                raise OverflowError
            return len(tokens) - 1

        def expand(x):  # writes x's yield, returns the position of x's head
            body = draw.choices(self.rules[x], cum_weights=self.rule_cum[x])[0]
            children = [emit(sym) if sym >= 0 else expand(-sym - 1) for sym in body]
            head = emit(draw.choices(range(self.n_terminals), cum_weights=self.head_cum[x])[0])
            for c in children:
                parents[c] = head
            return head

        try:
            expand(draw.randrange(len(self.rules)))
        except OverflowError:
            return None
        return tokens, parents


def make_atr_split(grammar, n, stream, allow=None, query="parent"):
    """n documents `BOS yield EOS child parent EOS`. A worked example (terminals t0.., ids from 3):

        position  0    1   2   3   4    5   6   7   8
        token     BOS  t4  t9  t4  t1   EOS t9  t1  EOS
        label     -    -   -   -   -    -   t1  -   -
        tree      t1 (position 4) heads t4 (1), t9 (2) and t4 (3)

    The paper's query names a child by its type alone, so the child must be the rightmost of its type (t9 at 2,
    t4 at 3, not t4 at 1), and asks for its parent: an answer position is drawn uniformly among those with such a
    child, then one of its children. Named positions: key = the child in the sentence (2), value = its parent (4,
    always to the right), next_key = key+1 (3), divider (5), query (6), answer (7). Sentences under 3 tokens or
    over MAX_LEN - 5, or without a query, are redrawn. The variants: query="inner" asks for the parent only where
    it is not the root (the sentence's last token); query="sibling" (App. D.4) for the rightmost child of the
    same parent, itself the rightmost of its type (the child itself if none lies right of it: value = -1).
    allow(answer type, child type) restricts the queries (the generalisation split). Document i draws from its
    own stream random.Random(f"{stream}/{i}"), so any document can be regenerated alone."""
    docs, positions = [], []  # per document: key, value, next_key, divider, query, answer
    for i in range(n):
        rng = random.Random(f"{stream}/{i}")
        for _ in range(100_000):  # bounded: a rejection loop must end
            sentence = grammar.sample(rng, MAX_LEN - 5)
            if sentence is None or len(sentence[0]) < 3:
                continue
            tokens, parents = sentence
            rightmost = {t: j for j, t in enumerate(tokens)}  # each type's last position: a child a query can name
            last_child = {p: j for j, p in enumerate(parents)}  # each parent's (-1: the root's) rightmost child
            offers = {}  # answer position -> the children that may be queried for it
            for child in sorted(rightmost.values()):
                answer = last_child[parents[child]] if query == "sibling" else parents[child]
                ok = {"parent": True, "inner": parents[answer] >= 0, "sibling": rightmost[tokens[answer]] == answer}
                if answer >= 0 and ok[query] and (allow is None or allow(tokens[answer], tokens[child])):
                    offers.setdefault(answer, []).append(child)
            if offers:
                break
        else:
            raise ConfigError(f"100,000 sentences in a row had no query allowed in stream {stream}; with "
                              f"atr_split=gen, choose an atr_heldout that holds out some pairs but not nearly all")
        answer = rng.choice(sorted(offers))  # uniform over answers, then children
        child, L = rng.choice(offers[answer]), len(tokens)
        docs.append([BOS] + [t + 3 for t in tokens] + [EOS, tokens[child] + 3, tokens[answer] + 3, EOS])
        positions.append((1 + child, 1 + answer if answer != child else -1, 2 + child, L + 1, L + 2, L + 3))
    return make_split(docs, dict(zip(("key", "value", "next_key", "divider", "query", "answer"), zip(*positions))))


def make_task(cfg, train=True):
    """The task of cfg, deterministic per cfg.seed. Grammar, training and evaluation data have separate
    streams, so the evaluation split does not depend on n_train (train=False skips the training split)."""
    if cfg.task == "ar":
        K, V = cfg.n_keys, cfg.n_values
        rng = lambda stream: np.random.default_rng([cfg.seed, stream])
        return Task("ar", 3 + K + V, make_ar(cfg, cfg.n_train, rng(0)) if train else None,
                    make_ar(cfg, cfg.n_eval, rng(1)), {"key": (3, 3 + K), "value": (3 + K, 3 + K + V)})
    max_body, n_terminals = ATR_SETTINGS[cfg.atr_setting]
    grammar_rng = np.random.default_rng([cfg.seed, 2])
    grammar = Grammar(grammar_rng, n_terminals, max_body)
    heldout, allow, test = None, None, None
    if cfg.atr_split == "gen":  # hold out a random fraction of (parent type, child type) pairs
        heldout = grammar_rng.random((n_terminals, n_terminals), dtype=np.float32) < cfg.atr_heldout
        if heldout.all() or not heldout.any():
            raise ConfigError(f"atr_heldout={cfg.atr_heldout} holds out {int(heldout.sum())} of the {heldout.size} "
                              f"(parent, child) pairs; both splits need some")
        allow = lambda p, c: not heldout[p, c]
        test = make_atr_split(grammar, cfg.n_eval, f"{cfg.seed}/test", lambda p, c: heldout[p, c], cfg.atr_query)
    gen = "" if cfg.atr_split == "iid" else "/heldout"
    train = make_atr_split(grammar, cfg.n_train, f"{cfg.seed}/train{gen}", allow, cfg.atr_query) if train else None
    evals = make_atr_split(grammar, cfg.n_eval, f"{cfg.seed}/{'iid' if heldout is None else 'dev'}", allow,
                           cfg.atr_query)
    terminals = (3, 3 + n_terminals)  # the child and its parent are both terminals
    return Task("atr", 3 + n_terminals, train, evals, {"key": terminals, "value": terminals},
                None if heldout is None else torch.from_numpy(heldout), test, cfg.atr_query)


# ----------------------------------------------------------------------------------------------------
# One whole model (tinylang model/arch/zoology.py): embedding -> blocks (a mixer, an MLP) -> LayerNorm -> LM
# head tied to the embedding. Only the mixer differs: attention here, the rest in the catalogue.

def register(name, lr):
    """Make Mixer, a class (or a function of cfg, layer_idx), `--arch name` with lr its default rate. The
    contract, checked when a Config names the mixer: Mixer(cfg, layer_idx) is the nn.Module of block
    layer_idx (cfg.d_model = d); its forward maps the normed stream (B, L, d) to (B, L, d), causally (output t
    reads input up to t). Mark its output projection with writes_residual; build a short conv as a ShortConv."""
    why = ("the name must be a Python identifier" if not str(name).isidentifier() else
           "that arch is registered already" if name in ARCHS else
           "the default learning rate must be a positive number" if isinstance(lr, bool) or not (
               isinstance(lr, numbers.Real) and 0 < lr < math.inf) else None)
    if why:
        raise ConfigError(f"register({name!r}, lr={lr!r}): {why}")

    def wrap(cls):
        ARCHS[name], DEFAULT_LR[name] = cls, lr
        return cls
    return wrap


def writes_residual(linear):
    """Mark a projection that writes the residual stream, so that the init scales it down (GPT-2's
    1/√(2·n_layers)). zoology picks these by name (out_proj, fc2); here each mixer marks its own."""
    linear.writes_residual = True
    return linear


@register("attention", lr=1e-3)
class Attention(nn.Module):
    """Causal softmax self-attention with one head (Vaswani et al. 2017; zoology mixers/attention.py, MHA).

        [q | k | v] = u W_qkvᵀ            (no bias)
        o = softmax(q kᵀ / √d + mask) v    mask[t, s] = -inf for s > t (zoology: -1e4)
        out = o W_oᵀ + b_o                 (out_proj has a bias, as zoology's)

    scaled_dot_product_attention computes the softmax above (the tests check it against the formula).
    """

    def __init__(self, cfg, layer_idx):
        super().__init__()
        d = cfg.d_model
        self.Wqkv = nn.Linear(d, 3 * d, bias=False)
        self.out_proj = writes_residual(nn.Linear(d, d))

    def forward(self, u):                          # (B, L, d)
        q, k, v = self.Wqkv(u).chunk(3, dim=-1)    # 3 x (B, L, d)
        return self.out_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class ShortConv(nn.Conv1d):
    """Causal depthwise convolution y = h * u, short filter h (zoology's ShortConvolution, Mamba's conv1d). Most of
    the catalogue calls one; its output is the site conv_output, where a conv carries a token to the next positions."""

    def __init__(self, channels, width, bias=True):
        super().__init__(channels, channels, width, groups=channels, bias=bias)  # padded in kernels.short_conv

    def forward(self, u):              # (B, L, channels) -> (B, L, channels)
        return kernels.short_conv(u, self.weight[:, 0], self.bias)


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), writes_residual(nn.Linear(4 * d, d))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))  # exact-erf GELU


class Block(nn.Module):
    """Pre-norm residual block: r = r + mixer(LN(r)); r = r + MLP(LN(r)). The sites block_input / block_output
    are r in and out: block_output of layer l is the same tensor as block_input of l+1. A mixer class may bring
    its own block: its `norm` in place of LayerNorm, and `mlp = False` for none (Mamba's, in the catalogue)."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        d, mixer_cls = cfg.d_model, ARCHS[cfg.arch]
        self.norm1 = getattr(mixer_cls, "norm", nn.LayerNorm)(d)
        self.mixer = mixer_cls(cfg, layer_idx)
        self.norm2, self.mlp = (nn.LayerNorm(d), MLP(d)) if getattr(mixer_cls, "mlp", True) else (None, None)

    @property
    def conv(self):  # the site conv_output: the mixer's ShortConv, if any
        return next((mod for mod in self.mixer.modules() if isinstance(mod, ShortConv)), None)

    def forward(self, r):                # (B, L, d) -> (B, L, d)
        r = r + self.mixer(self.norm1(r))
        if self.mlp is not None:
            r = r + self.mlp(self.norm2(r))
        return r


class LanguageModel(nn.Module):
    def __init__(self, cfg, vocab_size):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        positions = cfg.pos_emb == "on" or (cfg.pos_emb == "auto" and cfg.arch == "attention")
        self.pos_emb = nn.Embedding(MAX_LEN, cfg.d_model) if positions else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)  # every architecture's, Mamba's too (zoology's LanguageModel)

    def hidden(self, ids):               # (B, L) -> (B, L, d), after the final LayerNorm
        x = self.embed(ids)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def head(self, x):                   # (..., d) -> (..., V), tied to the token embedding
        return x @ self.embed.weight.T

    def forward(self, ids):              # (B, L) -> logits (B, L, V)
        return self.head(self.hidden(ids))


def zoology_init(model, n_layers):
    """zoology's _init_weights, rule by rule below; Conv1d and SSM parameters keep their own."""
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.Linear)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    for m in (m for m in model.modules() if getattr(m, "writes_residual", False)):
        nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * n_layers))


def build_model(cfg, vocab_size):
    """The model of cfg, initialised from cfg.seed (the global torch RNG is left as it was) by zoology_init, or by
    the mixer class's own init_weights (Mamba's)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LanguageModel(cfg, vocab_size)
        getattr(ARCHS[cfg.arch], "init_weights", zoology_init)(model, cfg.n_layers)
    return model


# ----------------------------------------------------------------------------------------------------
# Training, as the paper: AdamW (0.9, 0.999), no weight decay, 10 % linear warm-up then cosine to 0, batch 32,
# fp32, cross-entropy on the answer only. Evaluation: accuracy and mean p(answer) on the evaluation split.

class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite."""


def answer_logits(model, ids, query):
    """Logits (B, V) at the query position of each document: ids (B, L), query (B,). Computing the
    head only where the loss is read saves a (B, L, V) product."""
    return model.head(model.hidden(ids)[torch.arange(len(ids), device=ids.device), query])  # (B, d) -> (B, V)


def readable(model, split):
    """Refuse (one ValueError) a split the model cannot read: empty, or of another vocabulary (the model's first
    nn.Embedding is its token table)."""
    n = next(mod.num_embeddings for mod in model.modules() if isinstance(mod, nn.Embedding))
    if not len(split.input_ids):
        raise ValueError("this split holds no documents")
    top, known = int(split.input_ids.max()), getattr(split, "vocab_size", 0)
    if top >= n or known not in (0, n):
        raise ValueError(f"this split is of a task of {known or f'over {top}'} tokens, not of this model's {n}")


@torch.no_grad()
def evaluate(model, split, batch_size=512):
    """Answer accuracy and mean answer probability on a split; also the predictions (M,)."""
    if not (isinstance(batch_size, int) and batch_size > 0):
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
    readable(model, split)
    device = next(model.parameters()).device
    preds, probs = [], []
    for i in range(0, len(split), batch_size):
        sl = slice(i, i + batch_size)
        ids = split.input_ids[sl, :int(split.lengths[sl].max())].to(device)
        logp = answer_logits(model, ids, split.pos["query"][sl].to(device)).log_softmax(-1)  # (B, V)
        preds.append(logp.argmax(-1).cpu())
        probs.append(logp.gather(1, split.answers[sl, None].to(device))[:, 0].exp().cpu())
    preds = torch.cat(preds)
    return {"acc": (preds == split.answers).float().mean().item(), "p_answer": torch.cat(probs).mean().item(),
            "preds": preds}


def setup(cfg):
    """cfg's device (auto: CUDA, then MPS, then CPU), with denormals flushed on a CPU (10-20x slower there)
    and fp32 convolutions on CUDA (torch's default there is TF32)."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    device = next(kind for kind, ok in available.items() if ok) if cfg.device == "auto" else cfg.device
    if not available[device.split(":")[0]]:
        raise ConfigError(f"device '{device}' is not available here; use auto or cpu")
    torch.set_flush_denormal(device == "cpu")
    torch.backends.cudnn.allow_tf32 = False
    return device


def answer_loss(model, ids, query, answer):
    return F.cross_entropy(answer_logits(model, ids, query), answer)


def step_loss(compile, device):
    if not compile:
        return answer_loss
    torch._dynamo.reset()  # one model per compile cache
    mode = "reduce-overhead" if device.startswith("cuda") else None  # CUDA graphs; forward and backward compile
    return torch.compile(answer_loss, mode=mode, dynamic=False)


def train_step(model, optimizer, ids, query, answer, loss_fn=answer_loss):
    loss = loss_fn(model, ids, query, answer)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def lr_factor(step, warmup_steps, total_steps):
    """Linear warm-up to 1 over warmup_steps, then cosine decay to 0 at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Batches:
    """Epochs over the training documents, each a fresh permutation from the run's generator, or with fixed=True
    the stored order, as tinylang's experiment.py (batch k: documents [kB, kB+B)); the last partial batch is
    dropped. next(): the batch's indices (on the device) and its trimmed length."""

    def __init__(self, lengths, batch_size, seed, device="cpu", compile=False, fixed=False):
        self.lengths, self.batch_size, self.device = lengths, batch_size, device
        self.compile, self.fixed = compile, fixed
        self.gen, self.order, self.cursor = torch.Generator().manual_seed(seed), None, len(lengths)

    def next(self):
        if self.cursor + self.batch_size > len(self.lengths):  # a new epoch
            n = len(self.lengths)
            self.set_order(torch.arange(n) if self.fixed else torch.randperm(n, generator=self.gen), 0)
        span, self.cursor = slice(self.cursor, self.cursor + self.batch_size), self.cursor + self.batch_size
        L = int(self.lengths[self.order[span]].max())  # ATR lengths vary
        if self.compile:  # a power of two from 16: few shapes to compile
            L = min(max(16, 1 << (L - 1).bit_length()), int(self.lengths.max()))
        return self.on_device[span], L

    def set_order(self, order, cursor):
        self.order, self.cursor, self.on_device = order, cursor, order.to(self.device)

    def state_dict(self):
        return {"batch_gen": self.gen.get_state(), "order": self.order, "cursor": self.cursor}

    def load_state_dict(self, state):
        self.gen.set_state(state["batch_gen"])
        self.set_order(state["order"], state["cursor"])


def fmt_time(s):
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def fit(cfg, run, log=print):
    """Train the model of cfg as the paper, then read how it recalls; returns the results. `run` keeps the run's
    folder (a Run, which train makes): begin restores a checkpoint and returns the steps it has done, checkpoint
    writes each evaluation (status "running"), end the final weights ("trained"), save the status: "nonfinite"
    (model.pt keeps the last checkpoint; a rerun refuses) or, with the grid, "completed" ("target reached")."""
    device = setup(cfg)
    task = make_task(cfg)
    model = build_model(cfg, task.vocab_size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2), weight_decay=0, fused=True)
    warmup_steps = int(cfg.warmup * cfg.steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, cfg.steps))
    batches = Batches(task.train.lengths, cfg.batch_size, cfg.seed, device, cfg.compile, cfg.batch_order == "fixed")
    done = run.begin(task, model, optimizer, schedule, batches)  # steps done: 0, or its checkpoint's
    ids, query, answer = (t.to(device) for t in (task.train.input_ids, task.train.pos["query"], task.train.answers))
    loss_fn, loss_sum, ev = step_loss(cfg.compile, device), torch.zeros((), device=device), None
    for step in range(done + 1, cfg.steps + 1):
        idx, L = batches.next()  # B documents, their padding trimmed to the longest
        loss_sum += train_step(model, optimizer, ids[idx, :L], query[idx], answer[idx], loss_fn).detach()
        schedule.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            ev, loss = evaluate(model, task.eval), (loss_sum / (step - done)).item()
            if not (math.isfinite(loss) and math.isfinite(ev["p_answer"])):  # diverged: stop at the last checkpoint
                run.save("nonfinite")
                kept = done and f"{run.path('model.pt')} keeps the checkpoint of step {done}"
                raise NonFiniteLoss(f"the training loss became {loss}, p(answer) {ev['p_answer']}, between steps "
                                    f"{done + 1} and {step} (lr={cfg.lr:g}); {kept or 'no checkpoint was kept'}")
            h = {"step": step, "loss": round(loss, 5), "acc": ev["acc"], "p_answer": round(ev["p_answer"], 5),
                 "lr": schedule.get_last_lr()[0]}
            if cfg.analyze_every and step // cfg.analyze_every > done // cfg.analyze_every:  # the mechanism forming
                h.update(watch(model, task, cfg))
            per_step = run.checkpoint(h, ev)  # history, results.json, model.pt; seconds a step
            watched = "verdict" in h and f" | train acc {h['train_acc']:.4f}, {verdict_text(h['verdict'], False)}"
            log(f"step {step:>6}/{cfg.steps} | loss {loss:.4f} | acc {ev['acc']:.4f} | p(answer) {ev['p_answer']:.3f}"
                f" | {1000 * per_step:.2f} ms/step | eta {fmt_time(per_step * (cfg.steps - step))}{watched or ''}")
            loss_sum.zero_()
            done = step
            if 0 < cfg.target_acc <= ev["acc"]:  # the early stop
                break
    ev = ev or evaluate(model, task.eval)  # the final evaluation (anew if resumed at the end)
    results = run.end(ev)  # the final weights: the run is "trained" until its grid is added
    analyze(model, task, cfg, results, log, intervene=cfg.analyze)  # the grid and its verdict (below)
    return run.save(results["ended"])  # finished


# ----------------------------------------------------------------------------------------------------
# Interchange interventions (the paper's metric; tinylang eval/interchange.py). Each document runs clean and
# corrupted, its key replaced by another token of its kind. One clean activation, at one site,
# layer and position, is patched into the corrupted run; how much of p(answer) comes back?
#     attribution = (mean p_patched - mean p_corrupt) / (mean p_clean - mean p_corrupt),
# each mean over the documents that have the position (next_key: not where the last pair is queried). A site is the
# first positional input (_input) or the output (_output) of one module, found by its path with {layer} in it, as
# pyvene's type_to_module_mapping. SITES maps mecheval's models; any other model brings its own mapping (README:
# "Your own model"): nothing from here to verdict_text names a module of mecheval's.

SITES = {"block_input": "blocks.{layer}",        # the residual stream into Block
         "mixer_input": "blocks.{layer}.mixer",
         "conv_output": "blocks.{layer}.conv",   # the mixer's ShortConv, if any (Block.conv)
         "mixer_output": "blocks.{layer}.mixer",
         "mlp_input": "blocks.{layer}.mlp",      # none in Mamba's blocks
         "mlp_output": "blocks.{layer}.mlp",
         "block_output": "blocks.{layer}"}       # the same tensor as block_input of the next layer
POSITIONS = ("key", "value", "next_key", "divider", "query")


def site_module(model, site, layer, sites=SITES):
    """The module whose input or output is `site` in `layer`; None where the model holds None there (Mamba's mlp,
    Block.conv without a ShortConv). A path the model lacks is one ValueError sentence."""
    if site not in sites:
        raise ValueError(f"unknown site '{site}'; allowed: {', '.join(sites)}")
    module, path = model, sites[site].format(layer=layer)
    for name in path.split("."):
        module = getattr(module, name, "missing")  # a ModuleList's item too: getattr(blocks, "0")
        if not isinstance(module, (torch.nn.Module, type(None))):
            raise ValueError(f"site '{site}' of layer {layer}: the model has no module '{path}'")
    return module


def model_sites(model, sites=SITES):
    """Every (site, layer) of the model but where its module is None. The layers are the items of the list that
    {layer} indexes in the mapping's first path with one (mecheval's blocks, GPT-2's transformer.h)."""
    site, path = next((s, p) for s, p in sites.items() if ".{layer}" in p)
    layers = len(site_module(model, site, 0, {site: path.split(".{layer}")[0]}))
    return [(site, layer) for layer in range(layers) for site in sites
            if site_module(model, site, layer, sites) is not None]


@contextmanager
def hooks(model, edits, sites=SITES):
    """Run the model with edits = {(site, layer): fn}: fn(x) gets the activation x (B, L, channels), the module's first
    positional input or its output (a tuple's first element), and returns its replacement, or None. Every other
    argument and element passes through. A site that does not run raises ValueError; the hooks go on exit."""
    handles, ran = [], set()

    def edit(key, fn, x, what):  # x: the module's positional arguments, or its output
        first = x[0] if isinstance(x, tuple) and x else x
        if not torch.is_tensor(first):
            raise ValueError(f"site '{key[0]}' of layer {key[1]}: its module's {what} is not a tensor (B, L, channels)"
                             + "; called by keywords only" * (isinstance(x, tuple) and not x))
        ran.add(key)
        new = fn(first)
        return None if new is None else (new, *x[1:]) if isinstance(x, tuple) else new
    try:
        for key, fn in edits.items():
            module = site_module(model, *key, sites)
            if module is None:
                raise ValueError(f"site '{key[0]}' does not exist in layer {key[1]} of this model")
            if key[0].endswith("_input"):  # what a pre-hook returns replaces *all* the positional arguments
                handles.append(module.register_forward_pre_hook(
                    lambda mod, args, key=key, fn=fn: edit(key, fn, args, "first positional input")))
            else:
                handles.append(module.register_forward_hook(
                    lambda mod, args, out, key=key, fn=fn: edit(key, fn, out, "output")))
        yield
        idle = [key for key in edits if key not in ran]
        if idle:
            raise ValueError(f"site '{idle[0][0]}' of layer {idle[0][1]}: its module did not run in the forward")
    finally:
        for h in handles:
            h.remove()


def read_at(positions, into, prefix=()):
    """A hook fn that stores the activation at named positions: into[prefix + (name,)] = x[b, positions[name][b]]
    (B, d). A position of -1 (none in this document) reads position 0, which the caller ignores."""
    def fn(x):
        rows = torch.arange(len(x), device=x.device)
        for name, p in positions.items():
            into[prefix + (name,)] = x[rows, p.clamp(min=0)]
    return fn


def write_at(positions, values):
    """A hook fn that replaces x[b, positions[b]] by values[b] (B, d), except where positions[b] < 0."""
    def fn(x):
        x, rows = x.clone(), (positions >= 0).nonzero()[:, 0]
        x[rows, positions[rows]] = values[rows].to(x.dtype)
        return x
    return fn


def patch(model, ids, site, layer, positions, values, forward=None, sites=SITES):
    """forward(ids) (default: the model) with the activation at `site` of `layer` replaced, in document b at
    positions[b] (-1: nowhere), by values[b]: a patched forward, the intervention's one step."""
    with hooks(model, {(site, layer): write_at(positions, values)}, sites):
        return (forward or model)(ids)


def logits_of(out):
    """The logits (B, L, V) in a model's output: itself, its first element (nanoGPT) or "logits" (Hugging Face)."""
    return out["logits"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out


def query_logits(model, ids, query):
    """Logits (B, V) at each document's query: ids (B, L), query (B,)."""
    if hasattr(model, "hidden") and hasattr(model, "head"):  # mecheval's: the head at the query only
        return answer_logits(model, ids, query)
    logits = logits_of(model(ids))
    if logits.shape[:2] != ids.shape:
        raise ValueError(f"the model gave logits of shape {tuple(logits.shape)} for ids of shape {tuple(ids.shape)}; "
                         f"mechanism needs (B, L, V)")
    return logits[torch.arange(len(ids), device=ids.device), query]


def corrupt_tokens(task, split, which, gen):
    """The split's ids with the token at pos[which] replaced by a uniformly random *other* token of the
    same class (another key / value for AR, another terminal for ATR)."""
    lo, hi = task.classes[which]
    ids, rows, at = split.input_ids.clone(), torch.arange(len(split.input_ids)), split.pos[which]
    new = lo + torch.randint(0, hi - lo - 1, (len(rows),), generator=gen)  # skip the original below
    ids[rows, at] = new + (new >= ids[rows, at]).long()
    return ids


def check_inputs(model, task, split, corrupt):
    """What mechanism reads (a ValueError names what is missing): split.input_ids (M, L), ids the model can read;
    split.lengths and split.answers (M,); split.pos[name] (M,) for each of POSITIONS, -1 where a document lacks
    it; task.classes[corrupt] = (lo, hi), the ids [lo, hi) a corrupted token is drawn from."""
    need = [f"split.{a}" for a in ("input_ids", "lengths", "answers", "pos") if not hasattr(split, a)]
    need += [f"split.pos['{k}']" for k in POSITIONS if k not in getattr(split, "pos", POSITIONS)]
    need += [] if corrupt in getattr(task, "classes", {}) else [f"task.classes['{corrupt}']"]
    if need:
        raise ValueError(f"mechanism needs {need[0]} (see check_inputs)")
    if (split.pos[corrupt] < 0).any():
        raise ValueError(f"corrupt='{corrupt}' needs a {corrupt} in every document; "
                         f"{int((split.pos[corrupt] < 0).sum())} of {len(split.input_ids)} have none")
    if model.training and any(isinstance(mod, nn.Dropout) and mod.p > 0 for mod in model.modules()):
        raise ValueError("the model is in training mode and has dropout: call model.eval() first")
    readable(model, split)


@torch.no_grad()
def mechanism(model, task, corrupt="key", seed=0, split=None, cells=None, sites=SITES):
    """The grid: an interchange intervention at every (site, layer, position) of `sites`, or at `cells` only, on a
    split (default: eval). One clean forward reads every activation the cells patch in, one corrupted forward gives
    p_corrupt, then one patched forward a cell, batched over the M documents, each patched at its own position:
    2 + cells forwards. Returns p_clean, p_corrupt, the grid (one entry a cell) and the verdict (None if `cells`
    lack what it reads)."""
    t0, device = time.time(), next(model.parameters()).device
    split = task.eval if split is None else split
    if corrupt not in ("key", "value") or not (isinstance(seed, int) and 0 <= seed < 2 ** 63):
        raise ValueError(f"unknown corrupt '{corrupt}'; allowed: key, value" if corrupt not in ("key", "value") else
                         f"seed must be an integer from 0 to 2**63 - 1, not {seed!r}")
    check_inputs(model, task, split, corrupt)
    L = int(split.lengths.max())
    clean = split.input_ids[:, :L].to(device)
    corrupted = corrupt_tokens(task, split, corrupt, torch.Generator().manual_seed(seed))[:, :L].to(device)
    query, answer = split.pos["query"].to(device), split.answers.to(device)
    pos = {k: split.pos[k].to(device) for k in POSITIONS}
    rows = torch.arange(len(clean), device=device)

    def p_answer(ids):  # (M,) probability of the correct answer at the query
        return query_logits(model, ids, query).softmax(-1)[rows, answer]

    layers = {layer for _, layer in model_sites(model, sites)}
    if cells is not None and (not cells or any(k not in POSITIONS or l not in layers for _, l, k in cells)):
        raise ValueError(f"cells must be a non-empty list of (site, layer, position), layer one of "
                         f"{sorted(layers)} and position one of {', '.join(POSITIONS)}")
    cells = cells or [(site, layer, k) for site, layer in model_sites(model, sites) for k in POSITIONS]
    acts = {}  # (site, layer, position) -> (M, d or conv channels): the clean activations patched in
    with hooks(model, {(site, layer): read_at(pos, acts, (site, layer)) for site, layer, _ in cells}, sites):
        p_clean = p_answer(clean)
    if not torch.isfinite(p_clean).all():
        raise ValueError("p(answer) is not finite on this split: the model holds NaN or inf")
    logits = query_logits(model, corrupted, query)  # the corrupted run: its p(answer) and its accuracy
    p_corrupt, acc_corrupt = logits.softmax(-1)[rows, answer], (logits.argmax(-1) == answer).float().mean().item()
    means = []  # per cell: mean p_clean, p_corrupt, p_patched over the documents that have the position
    for site, layer, k in cells:
        p_patched = patch(model, corrupted, site, layer, pos[k], acts[site, layer, k], p_answer, sites)
        has = (pos[k] >= 0).float()
        mean = lambda p: (p * has).sum() / has.sum().clamp(min=1)
        means.append(torch.stack([mean(p_clean), mean(p_corrupt), mean(p_patched)]))
    grid = []
    for (site, layer, k), (clean_p, corrupt_p, patched_p) in zip(cells, torch.stack(means).tolist()):
        gap = clean_p - corrupt_p
        grid.append({"site": site, "layer": layer, "position": k, "p_clean": clean_p, "p_corrupt": corrupt_p,
                     "p_patched": patched_p, "attribution": (patched_p - corrupt_p) / gap if gap > 0.01 else None})
    result = {"corrupt": corrupt, "query": getattr(task, "query", "parent"), "n_docs": len(clean),
              "p_clean": p_clean.mean().item(), "p_corrupt": p_corrupt.mean().item(), "acc_corrupt": acc_corrupt,
              "n_layers": len(layers), "grid": grid, "forwards": 2 + len(grid), "seconds": round(time.time() - t0, 3)}
    read = {(g["site"], g["layer"], g["position"]) for g in grid} >= set(verdict_cells(len(layers)))
    result["verdict"] = verdict(result) if read else None  # None: `cells` lack what the verdict reads
    return result


def verdict_cells(n_layers):
    """The cells verdict reads: each layer's block_output at the query; from layer 1 on, block_input at each position
    of ROUTE and at the query."""
    return [("block_output", l, "query") for l in range(n_layers)] + [
        ("block_input", l, k) for l in range(1, n_layers) for k in (*ROUTE, "query")]


# the route that a high attribution at each position of the retrieving layer's input means
ROUTE = {"value": "induction", "key": "direct retrieval", "next_key": "direct retrieval from the next key"}


def verdict(mech, threshold=0.5):
    """The paper's reading of the grid. The question is where layer 1 finds what it needs: the last layer's input
    (block_input) patched at one position brings p(answer) back only if that position's residual stream carries it.

    Two layers, the paper's models (layer-0 block_output is layer-1 block_input, the same tensor):
        layer-0 block_output at the query >= 0.5   direct retrieval in layer 0 (the answer is made at the query)
        else the highest of layer-1 block_input at value, key, next key (query is shown, not ranked):
          value >= 0.5     induction: layer 0 copied the key onto the value token, where layer 1 matches the query
                           against it and copies that value, as an induction head does
          key >= 0.5       direct retrieval in layer 1 (its mixer reads the key itself)
          next key >= 0.5  direct retrieval from the next key (a short conv moved the key on to it)
          none, or a tie   mixed

    Deeper models: the first layer whose block_output at the query reaches 0.5 (else the last) is the one that
    retrieves; if it is layer 0 that is direct retrieval in layer 0, else its block_input is read as layer 1's above.
    "no verdict": the corruption costs <= 0.01 of p(answer), so no attribution is defined. The rule reads a key
    corruption (corrupt=key). On ATR the value is the child's parent, often the very next token: there value and
    next key are one position, and a one-token carry reads as induction (split the documents to tell them apart).
    Sibling queries are not read: two thirds of the children answer themselves, with no value position."""
    unread = ("sibling queries" if mech.get("query") == "sibling" else
              "value corrupted" if mech.get("corrupt", "key") != "key" else None)
    gap, layer = mech["p_clean"] - mech["p_corrupt"], None
    if unread or gap <= 0.01:  # not read, or the corruption does not hurt this model: attributions would be noise
        kind, reads = (f"not read ({unread})", {}) if unread else ("no verdict", {"p_clean - p_corrupt": gap})
    else:
        attr = {(g["site"], g["layer"], g["position"]): g["attribution"] or 0.0 for g in mech["grid"]}
        n = mech["n_layers"]
        layer = next((l for l in range(n) if attr["block_output", l, "query"] >= threshold), n - 1)  # retrieves
        kind, reads = "direct retrieval", {"query": attr["block_output", 0, "query"]}
        if layer > 0:  # where did its input carry the answer?
            reads = {k: attr["block_input", layer, k] for k in ("value", "key", "next_key", "query")}
            first, second = sorted(ROUTE, key=reads.get, reverse=True)[:2]
            top, next_ = round(reads[first], 2), round(reads[second], 2)  # a tie as printed
            kind = ROUTE[first] if reads[first] >= threshold and top > next_ else "mixed"
    name = kind.replace("retrieval", f"retrieval in layer {layer}") if kind.startswith("direct") else kind
    return {"kind": kind, "layer": layer, "name": name, "reads": reads}


def verdict_text(v, numbers=True):
    """A verdict in words, with the attributions it rests on unless numbers=False."""
    if v is None or not v["reads"]:
        return "-" if v is None else v["kind"]
    kind, r = v["kind"], v["layer"]
    name = v.get("name") or (kind.replace("retrieval", f"retrieval in layer {r}") if kind.startswith("direct")
                             else kind)  # results.json of earlier versions hold no name
    if not numbers:
        return name
    where = {None: "the corruption does not hurt this model, so attributions would be noise:",
             0: "layer-0 block_output at the query:"}.get(r, f"layer-{r} block_input attribution:")
    return f"{name} ({where} " + ", ".join(f"{k} {x:.{3 if r is None else 2}f}" for k, x in v["reads"].items()) + ")"


def format_mechanism(mech):
    """A compact heatmap: rows = layer x site, columns = positions, attribution with a shade."""
    shade = " ░▒▓█"
    head = (f"interchange interventions: {mech['corrupt']} corrupted, {mech['n_docs']} documents, "
            f"p(answer) clean {mech['p_clean']:.3f}, corrupted {mech['p_corrupt']:.3f} (acc {mech['acc_corrupt']:.3f})")
    lines = [head, f"{'site':<14}{'layer':>5}  " + "".join(f"{k:>10}" for k in POSITIONS)]
    cells = {}
    for g in mech["grid"]:
        cells.setdefault((g["layer"], g["site"]), {})[g["position"]] = g["attribution"]
    for (layer, site), row in cells.items():
        lines.append(f"{site:<14}{layer:>5}  " + "".join("       n/a" if row[k] is None else
                                                         f"{shade[min(4, max(0, int(row[k] * 5)))]:>4}{row[k]:6.2f}"
                                                         for k in POSITIONS))
    return "\n".join(lines + [f"verdict: {verdict_text(mech['verdict'])}"])


def analyze(model, task, cfg, results, log=print, intervene=True):
    """Adds the test split's accuracy, if there is one, to results; if intervene, adds each split's grid (mechanism,
    mechanism_test) and prints it as a table that ends in the verdict."""
    if task.test is not None:
        ev = evaluate(model, task.test)
        results.update(test_acc=ev["acc"], test_p_answer=ev["p_answer"])
        log(f"test split (held-out pairs): acc {ev['acc']:.4f}, p(answer) {ev['p_answer']:.3f}")
    for key, split in (("mechanism", task.eval), ("mechanism_test", task.test)) if intervene else ():
        if split is not None:
            results[key] = mechanism(model, task, cfg.corrupt, cfg.seed, split)
            log(("on the test split, " if key == "mechanism_test" else "") + format_mechanism(results[key]))
    return results


def watch(model, task, cfg):
    """The mechanism as it forms (at the first evaluation from each multiple of analyze_every): the verdict from the
    cells it reads (6 at 2 layers), the gap p_clean - p_corrupt, and the accuracy on n_eval training documents."""
    mech = mechanism(model, task, cfg.corrupt, cfg.seed, cells=verdict_cells(len(model.blocks)))
    return {"train_acc": evaluate(model, task.train[:cfg.n_eval])["acc"], "gap": mech["p_clean"] - mech["p_corrupt"],
            "verdict": mech["verdict"]}


# ----------------------------------------------------------------------------------------------------
# The other mixers, a catalogue: each with its paper, equation and original code, registered as Attention is.
# The paper's successes first (Based, Mamba, DeltaNet), then BaseConv, Hyena and H3, which fail AR. Skip H3 and
# its kernel on a first read: the hardest code here, for the paper's weakest model.

def conv_width(cfg, default):
    """--d_conv, the short convolution's width, in one place: auto keeps the mixer's default (the paper's: Mamba
    and DeltaNet 4, Based 3 in its even layers, BaseConv 3 even and long odd), 0 drops it (Mamba, DeltaNet), long
    makes it BaseConv's long implicit one (Based, BaseConv); else 1-1024. Hyena's width-3 one is fixed."""
    return default if cfg.d_conv == "auto" else cfg.d_conv if cfg.d_conv == "long" else int(cfg.d_conv)


def positional_features(l_max, emb_dim=3):
    """z_n = [t_n, cos(2π f n / l_max), -sin(2π f n / l_max)], t_n = n/(l_max-1), one almost zero frequency
    f = 1e-4 (zoology mixers/hyena.py, PositionalEmbedding; degenerate there too, kept for fidelity)."""
    t = torch.linspace(0, 1, l_max)[:, None]                       # (l_max, 1)
    f = torch.linspace(1e-4, (emb_dim - 1) // 2 - 1, (emb_dim - 1) // 2)
    w = 2 * math.pi * f * torch.arange(l_max)[:, None] / l_max      # (l_max, bands)
    return torch.cat([t, torch.cos(w), -torch.sin(w)], dim=-1)      # (l_max, 3)


class BaseConv(nn.Module):
    """BaseConv (Arora et al. 2024, "Zoology"; zoology mixers/base_conv.py): y = Conv(u) ⊙ (u W_pᵀ + b_p) + u.
    width > 0: a short causal conv with bias. width "long": the implicit long convolution
    Conv(u) = h * u + u with h = MLP(z) (3 -> 16 -> d, ReLU; no decay window) and frozen z, so the
    long variant adds u twice inside the mixer, as zoology's fft_conv does."""

    def __init__(self, d, width, l_max=MAX_LEN):
        super().__init__()
        self.projection = nn.Linear(d, d)
        self.long = width == "long"
        if self.long:
            self.z = nn.Parameter(positional_features(l_max), requires_grad=False)
            self.filter = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, d))
        else:
            self.conv = ShortConv(d, width)

    def forward(self, u):                                  # (B, L, d)
        if self.long:
            h = self.filter(self.z[:u.shape[1]]).T         # (d, L)
            conv = kernels.long_conv(u, h) + u
        else:
            conv = self.conv(u)
        return conv * self.projection(u) + u


class BasedAttention(nn.Module):
    """Based's Taylor linear attention (Arora et al. 2024; zoology mixers/based.py), one head, feature dim f=8:
        q, k, v = u W_qᵀ, u W_kᵀ (B, L, f), u W_vᵀ;  y_t = Σ_{s<=t} φ(q_t)·φ(k_s) v_s / Σ_{s<=t} φ(q_t)·φ(k_s)
    with φ the 2nd-order Taylor features (φ(q)·φ(k) = 1 + s + s²/2, s = q·k/√f); no q/k normalisation.
    zoology's init does not down-scale its output projection (proj_o), so it is not marked writes_residual."""

    def __init__(self, d, feature_dim=8):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(d, feature_dim, bias=False), nn.Linear(d, feature_dim, bias=False)
        self.v_proj, self.proj_o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.proj_o(kernels.based_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x)))


@register("based", lr=1e-3)
def based(cfg, layer_idx):
    """Based = zoology's Hybrid: BaseConv with a short conv (width 3: conv_width) in even
    layers, Taylor linear attention in odd layers. A 1-layer Based model is therefore only a BaseConv."""
    return BaseConv(cfg.d_model, conv_width(cfg, 3)) if layer_idx % 2 == 0 else BasedAttention(cfg.d_model)


@register("mamba", lr=3e-3)
class Mamba(nn.Module):
    """Mamba-1 (Gu & Dao 2023; state-spaces/mamba mamba_simple.py, Mamba), state N=16, expand 2 (E = 2d channels),
    dt rank ⌈d/16⌉, with the reference implementation's parameter names and shapes:
        [x | z] = u W_inᵀ;  x = SiLU(conv1d(x));  [δ | B | C] = x W_xᵀ;  Δ = softplus(δ W_dtᵀ + b_dt)
        y = selective_scan(x, Δ, A = -exp(A_log), B, C, D) ⊙ SiLU(z);  out = y W_outᵀ
    selective_scan, per channel e with state s_t (N,), from s_0 = 0 (kernels.selective_scan_ref is the loop):
        s_t = exp(Δ_t A) ⊙ s_{t-1} + Δ_t B_t x_t;   y_t = C_t · s_t + D x_t
    --d_conv 0 drops the convolution (x = SiLU(x)); the width-4 conv1d is still built, unused, as in
    tinylang's MambaWithoutConv, as a plain Conv1d: no conv_output site. Its block is mamba_ssm's Block:
    RMSNorm (eps 1e-5), then the mixer, and no MLP; its init is mamba_ssm's (init_weights)."""
    norm, mlp = functools.partial(nn.RMSNorm, eps=1e-5), False
    unroll = 40  # AR's 37 steps compile whole within 2 minutes; ATR medium's took over 14 min

    def __init__(self, cfg, layer_idx, d_state=16, expand=2):
        super().__init__()
        d = cfg.d_model
        E, N, r = expand * d, d_state, math.ceil(d / 16)
        self.d_conv = conv_width(cfg, 4)
        self.in_proj = nn.Linear(d, 2 * E, bias=False)
        self.conv1d = ShortConv(E, self.d_conv) if self.d_conv else nn.Conv1d(E, E, 4, groups=E, padding=3)
        self.x_proj = nn.Linear(E, r + 2 * N, bias=False)
        self.dt_proj = nn.Linear(r, E)
        self.A_log, self.D = nn.Parameter(torch.empty(E, N)), nn.Parameter(torch.empty(E))
        self.out_proj = writes_residual(nn.Linear(E, d, bias=False))
        self.n_layers = cfg.n_layers
        self.init_ssm()

    @torch.no_grad()
    def init_ssm(self):
        """A = -[1..N] in every channel, D = 1; Δ's projection: weight U(±r^-1/2), bias = softplus⁻¹(dt), dt
        log-uniform in [1e-3, 1e-1], >= 1e-4 (mamba_simple.py, Mamba.__init__)."""
        self.A_log.copy_(torch.log(torch.arange(1, self.A_log.shape[1] + 1).float()))
        self.D.fill_(1.0)
        nn.init.uniform_(self.dt_proj.weight, -self.dt_proj.in_features ** -0.5, self.dt_proj.in_features ** -0.5)
        dt = torch.exp(torch.rand(len(self.D)) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    @torch.no_grad()
    def init_out_proj(self):  # PyTorch's default U(±1/√fan_in), / √n_layers (mamba_ssm's)
        self.out_proj.reset_parameters()
        self.out_proj.weight /= math.sqrt(self.n_layers)

    def reset_parameters(self):
        """This mixer's whole init as mecheval builds it, for a host model: call it after the host's own init (say
        nanoGPT's N(0, 0.02) on every Linear, biases zeroed: Δ = ln 2 everywhere). Linear and conv weights: PyTorch's
        default."""
        for layer in (self.in_proj, self.conv1d, self.x_proj):
            layer.reset_parameters()
        self.init_out_proj()
        self.init_ssm()

    @staticmethod
    def init_weights(model, n_layers):
        """mamba_ssm's _init_weights: embeddings N(0, 0.02), out_proj redrawn (init_out_proj); the rest as built."""
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, Mamba):
                m.init_out_proj()

    def forward(self, u):                                               # (B, L, d)
        x, z = self.in_proj(u).chunk(2, dim=-1)                         # (B, L, E) each
        if self.d_conv:
            x = self.conv1d(x)
        x = F.silu(x)
        r, N = self.dt_proj.in_features, self.A_log.shape[1]
        delta, B, C = self.x_proj(x).split([r, N, N], dim=-1)
        delta = F.softplus(self.dt_proj(delta))                          # (B, L, E)
        scan = kernels.selective_scan  # on a CPU compiled up to `unroll` steps, beyond eager
        if torch.compiler.is_compiling() and (x.is_cuda or x.shape[1] > self.unroll):
            scan = kernels.selective_scan_parallel if x.is_cuda else torch.compiler.disable(kernels.selective_scan)
        y = scan(x, delta, -torch.exp(self.A_log.float()), B, C, self.D)
        return self.out_proj(y * F.silu(z))


@register("deltanet", lr=1e-3)
class DeltaNet(nn.Module):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024; fla layers/delta_net.py, DeltaNet), one head:
        q, k, v = SiLU(ShortConv4(x W_{q,k,v}ᵀ)) (no conv bias);  q, k L2-normalised;  β = σ(x W_βᵀ)
        S_t = S_{t-1} + k_t β_t (v_t - S_{t-1}ᵀ k_t)ᵀ;  o_t = S_tᵀ q_t / √d;  out = RMSNorm(o) W_oᵀ
    fp32 throughout (fla's kernel runs bf16). --d_conv: conv_width."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        d = cfg.d_model
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)  # fla's q_proj, k_proj, v_proj stacked
        self.b_proj, self.o_proj = nn.Linear(d, 1, bias=False), nn.Linear(d, d, bias=False)
        width = conv_width(cfg, 4)
        self.conv1d = ShortConv(3 * d, width, bias=False) if width else None  # fla's q/k/v_conv1d stacked
        self.o_norm = nn.RMSNorm(d, eps=1e-5)

    def forward(self, x):                                               # (B, L, d)
        qkv = self.qkv_proj(x)                                          # (B, L, 3d)
        if self.conv1d is not None:
            qkv = self.conv1d(qkv)
        q, k, v = F.silu(qkv).chunk(3, dim=-1)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(q.shape[-1])
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(self.b_proj(x))[..., 0]                    # (B, L)
        return self.o_proj(self.o_norm(kernels.delta_rule(q, k, v, beta)))


@register("base_conv", lr=3e-3)
def base_conv(cfg, layer_idx):
    """BaseConv with zoology's kernel_size=[3, -1, 3, -1]: short (width 3) in even layers, implicit long in
    odd ones. --d_conv (conv_width) makes every layer that kind, as the paper's ablation override.
    Deviation: zoology's list raises past 4 layers; here the alternation continues for any depth."""
    return BaseConv(cfg.d_model, conv_width(cfg, 3 if layer_idx % 2 == 0 else "long"))


@register("hyena", lr=3e-3)
class Hyena(nn.Module):
    """Hyena of order 2 (Poli et al. 2023; zoology mixers/hyena.py):
        [x1 | x2 | v] = ShortConv3(u W_inᵀ + b);  y = x2 ⊙ (h * (x1 ⊙ v));  out = y W_outᵀ + b
    The long filter h[c, n] = MLP(z_n)[c] · exp(-t_n |δ_c|) comes from a Sin-activated MLP of width 64
    whose frequency ω is shared by its three Sin layers, over trainable positional features z. The skip
    term D exists but is multiplied by 0 (tinylang passes bias=False)."""

    def __init__(self, cfg, layer_idx, order=64, l_max=MAX_LEN):
        super().__init__()
        d = cfg.d_model
        self.in_proj, self.out_proj = nn.Linear(d, 3 * d), writes_residual(nn.Linear(d, d))
        self.short_filter = ShortConv(3 * d, 3)
        self.z = nn.Parameter(positional_features(l_max))             # (l_max, 3), trainable here
        self.freq = nn.Parameter(torch.ones(order))                     # ω, shared by the Sin layers
        self.mlp = nn.ModuleList([nn.Linear(3, order), nn.Linear(order, order), nn.Linear(order, order)])
        self.filter_out = nn.Linear(order, d, bias=False)
        self.bias = nn.Parameter(torch.randn(d))                        # D, multiplied by 0 below
        self.register_buffer("t", torch.linspace(0, 1, l_max)[:, None], persistent=False)
        self.register_buffer("decay", torch.linspace(math.log(1e-2) / 1.5, math.log(1e-2) / 0.3, d).abs(),
                             persistent=False)

    def filter(self, L):                                                # -> (d, L)
        a = self.z[:L]
        for lin in self.mlp:
            a = torch.sin(self.freq * lin(a))
        return (self.filter_out(a) * torch.exp(-self.t[:L] * self.decay)).T

    def forward(self, u):                                               # (B, L, d)
        x1, x2, v = self.short_filter(self.in_proj(u)).chunk(3, dim=-1)
        v = v * x1
        y = kernels.long_conv(v, self.filter(u.shape[1])) + v * (0 * self.bias)
        return self.out_proj(y * x2)


@register("h3", lr=3e-3)
class H3(nn.Module):
    """H3 (Fu et al. 2023; zoology mixers/h3.py) with d_state N=1024 and head dim 2 (H = d/2 heads):
        k̃ = K_shift * k + D_k ⊙ k                 shift SSM: K_shift[c, j] = Σ_n B_s[c, n] C_s[c, n+j]
        ŷ_h = K_h * (k̃_h v_hᵀ) + D_h (k̃_h v_hᵀ)  diagonal S4D SSM over the 2x2 outer products of a head
        y_h = q_hᵀ ŷ_h;  out = y W_oᵀ + b_o        output channels ordered (j, h) as in zoology
    K_h[t] = 2 Re Σ_n C̃_n λ_n^t over N/2 conjugate-pair modes, S4D's bilinear discretisation (kernels.py):
    λ = (1 + ΔA/2) / (1 - ΔA/2), C̃ = C B Δ / (1 - ΔA/2), A_n = -exp(inv_A_real) + i A_imag, Δ = exp(log_dt);
    complex parameters are stored as real (..., 2) pairs, as in zoology. The shift SSM is a learned causal filter
    of up to N taps on k, no ShortConv: H3 has no conv_output site."""

    def __init__(self, cfg, layer_idx, d_state=1024, head_dim=2):
        super().__init__()
        d, N = cfg.d_model, d_state
        H, self.hd = d // head_dim, head_dim
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.output_linear = nn.Linear(d, d)
        self.shift_B = nn.Parameter(F.one_hot(torch.zeros(d, dtype=torch.long), N).float())  # e_1
        self.shift_C = nn.Parameter(torch.empty(d, N).uniform_(-1 / math.sqrt(N), 1 / math.sqrt(N)))
        self.shift_D = nn.Parameter(torch.randn(d))
        self.log_dt = nn.Parameter(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1)))
        self.inv_A_real = nn.Parameter(torch.full((H, N // 2), math.log(0.5)))
        self.A_imag = nn.Parameter(math.pi * torch.arange(N // 2).float().repeat(H, 1))
        self.B = nn.Parameter(torch.stack([torch.ones(H, N // 2), torch.zeros(H, N // 2)], -1))
        self.C = nn.Parameter(torch.view_as_real(torch.randn(H, N // 2, dtype=torch.cfloat)))
        self.D = nn.Parameter(torch.randn(H))

    def shift_kernel(self, L):                                          # -> (d, L)
        """K_shift[c, j] = Σ_n B_s[c, n] C_s[c, n+j] for lags j < L (zero from j = N): a cross-correlation.
        An FFT of size >= N + L has no wrap-around; a multiple of 256 keeps its prime factors small."""
        N = self.shift_B.shape[1]
        n = 256 * -(-(N + L) // 256)
        Fb, Fc = torch.fft.rfft(self.shift_B, n=n), torch.fft.rfft(self.shift_C, n=n)
        return F.pad(torch.fft.irfft(Fb.conj() * Fc, n=n)[:, :min(N, L)], (0, max(0, L - N)))

    def ssm_kernel(self, L):                                            # -> (H, L)
        return kernels.ssm_kernel(self.log_dt.exp(), -self.inv_A_real.exp(), self.A_imag, self.B, self.C, L)

    def forward(self, u):                                               # (B, L, d)
        Bsz, L, d = u.shape
        H, hd = d // self.hd, self.hd
        q, k, v = self.q_proj(u), self.k_proj(u), self.v_proj(u)
        k = kernels.long_conv(k, self.shift_kernel(L)) + self.shift_D * k
        # heads with the head dim outermost, (B, i, L, H): the hd² products k_i v_j of a head share its SSM
        # filter, so they are convolved as hd² batch rows of H channels, and no reduction is strided
        q, k, v = (t.view(Bsz, L, H, hd).permute(0, 3, 1, 2).contiguous() for t in (q, k, v))
        kv = (k[:, :, None] * v[:, None]).view(Bsz * hd * hd, L, H)             # (B·i·j, L, H)
        kv = (kernels.long_conv(kv, self.ssm_kernel(L)) + self.D * kv).view(Bsz, hd, hd, L, H)
        y = (q[:, :, None] * kv).sum(1)                                       # Σ_i q_i ŷ_ij: (B, j, L, H)
        return self.output_linear(y.transpose(1, 2).reshape(Bsz, L, d))       # channels ordered (j, h)


# ----------------------------------------------------------------------------------------------------
# The rest is machinery: validation, run folders and resume, sweeps and presets, command line.

@dataclass(frozen=True)
class Config(Settings):
    """Settings, and where the run goes; made, it checks each value and mixer and fills in the defaults."""
    out_dir: str = setting("runs", "folder that holds the run folders")
    run_name: str = setting("", "run folder name; empty = derived from the settings")

    def __post_init__(self):
        put = functools.partial(object.__setattr__, self)  # frozen: filled in only here
        put("d_conv", str(self.d_conv) if type(self.d_conv) is int else self.d_conv)  # d_conv=3 is "3"
        bad = next((message for wrong, message in config_errors(self) if wrong), None)
        if bad:
            raise ConfigError(bad)
        for f in fields(self):  # numpy's numbers become Python's (JSON's)
            put(f.name, f.type(getattr(self, f.name)) if f.type in (int, float) else getattr(self, f.name))
        put("lr", self.lr or DEFAULT_LR[self.arch])
        put("steps", self.steps or PAPER_STEPS[self.task])
        put("run_name", self.run_name or default_run_name(self))
        check_mixers(self)


def config_errors(c):
    """(is it wrong, what to say) for the settings of Config c, checked in this order."""
    kinds = {int: (numbers.Integral, "an integer"), float: (numbers.Real, "a number"), str: (str, "a string"),
             bool: (bool, "True or False")}
    for f in fields(c):
        v, (kind, name) = getattr(c, f.name), kinds[f.type]
        yield not isinstance(v, kind) or isinstance(v, bool) != (f.type is bool), f"{f.name} must be {name}, not {v!r}"
        yield f.type is int and abs(v) >= 2 ** 63, f"{f.name}={v} is out of range: below 2**63"
        yield f.type is str and "\0" in v, f"{f.name} {v!r} holds a NUL byte"
    default = {f.name: f.default for f in fields(c)}
    widths = {"mamba": 0, "deltanet": 0, "based": 1, "base_conv": 1}  # the narrowest (or long)
    for name, allowed in (("task", TASKS), ("arch", list(ARCHS)), ("pos_emb", ("auto", "on", "off")),
                          ("atr_setting", list(ATR_SETTINGS)), ("atr_split", ("iid", "gen")),
                          ("atr_query", ("parent", "inner", "sibling")),
                          ("corrupt", ("key", "value")), ("batch_order", ("shuffle", "fixed")),
                          ("device", ("auto", "cpu", "cuda", "cuda:N", "mps"))):
        value = getattr(c, name)
        yield value not in allowed and not (name == "device" and value.startswith("cuda:")), \
            f"unknown {name} '{value}'; allowed: {', '.join(map(str, allowed))}"
    yield c.d_conv != "auto" and c.arch not in widths, \
        f"d_conv applies to {', '.join(widths)}, not to arch={c.arch}; leave it auto"
    w, digits = widths.get(c.arch, 0), c.d_conv.isascii() and c.d_conv.isdigit()  # not "²"
    yield not (c.d_conv in ("auto", "long" if w else "auto") or digits and w <= int(c.d_conv) <= MAX_LEN), \
        f"d_conv={c.d_conv} is not a width for {c.arch}; allowed: {w} to {MAX_LEN}" + ", or long" * w
    yield c.run_name in (".", "..") or os.path.basename(c.run_name) != c.run_name, \
        f"run_name '{c.run_name}' must be one folder name, without '/' or '..'"
    for name in ("d_model", "n_layers", "batch_size", "eval_every", "n_pairs", "n_keys", "n_values", "n_train",
                 "n_eval"):
        yield getattr(c, name) <= 0, f"{name} must be a positive integer, not {getattr(c, name)}"
    yield c.analyze_every < 0, f"analyze_every must be 0 (none) or more, not {c.analyze_every}"
    yield c.analyze_every not in (0, default["analyze_every"]) and c.analyze_every % c.eval_every, (
        f"analyze_every={c.analyze_every} is not a multiple of eval_every={c.eval_every}: it checks at evaluations")
    yield not 0 <= c.seed < 2 ** 63, f"seed must be an integer from 0 to 2**63 - 1, not {c.seed}"
    yield c.steps < 0, f"steps must be positive (or 0 for the paper's schedule), not {c.steps}"
    yield not (math.isfinite(c.lr) and c.lr >= 0), f"lr must be a positive number (or 0 for the default), not {c.lr}"
    yield not 0 <= c.warmup < 1, f"warmup is a fraction of the steps in [0, 1), not {c.warmup}"
    yield not 0 <= c.beta2 < 1, f"beta2 is AdamW's second-moment decay in [0, 1), not {c.beta2}"
    yield not 0 <= c.target_acc <= 1, f"target_acc must lie in [0, 1], not {c.target_acc}"
    yield not 0 < c.atr_heldout < 1, f"atr_heldout is a fraction in (0, 1), not {c.atr_heldout}"
    ar, P, K, V = c.task == "ar", c.n_pairs, c.n_keys, c.n_values
    yield ar and P > min(K, V), f"n_pairs={P} distinct pairs need as many keys and values, not n_keys={K}, n_values={V}"
    yield ar and 2 * P + 5 > MAX_LEN, f"n_pairs={P} makes documents over {MAX_LEN} tokens; at most {MAX_LEN // 2 - 3}"
    yield ar and min(K, V) < 2, f"n_keys={K} and n_values={V} must be at least 2 (a corrupted key is another)"
    yield ar and K + V > 10 ** 7, f"n_keys={K} and n_values={V} make {K + V:,} tokens; at most 10,000,000"
    yield c.arch == "h3" and c.d_model % 2, f"h3 splits d_model into heads of 2 channels; d_model={c.d_model} is odd"
    for name in ("atr_setting", "atr_split", "atr_query") if ar else ("n_pairs", "n_keys", "n_values"):  # ignored
        yield getattr(c, name) != default[name], (f"{name}={getattr(c, name)} is an {'ATR' if ar else 'AR'} option; "
                                                  f"with task={c.task} leave it out")
    yield c.atr_query == "sibling" and c.corrupt == "value", \
        "corrupt=value needs a value in every document, which sibling queries lack; use key"
    yield c.atr_heldout != default["atr_heldout"] and c.atr_split != "gen", (
        f"atr_heldout={c.atr_heldout} applies to the generalisation split only; add --task atr --atr_split gen")
    steps = c.steps or PAPER_STEPS.get(c.task, 0)
    yield c.analyze_every not in (0, default["analyze_every"]) and c.analyze_every > steps, (
        f"analyze_every={c.analyze_every} is more than the {steps} steps: no check would run")
    yield c.batch_size > c.n_train, f"batch_size={c.batch_size} is larger than the training set (n_train={c.n_train})"


CHECKED = set()  # (mixer, d, layers, d_conv) checked


def check_mixers(cfg):
    """register's contract on cfg's mixers of layers 0 and 1 (once per shape), else a ConfigError: row t of a batch
    keeps u up to t, the rest new; outputs to t equal u's (t < 32, t = 0 of MAX_LEN), in u's shape."""
    key = (ARCHS[cfg.arch], cfg.d_model, cfg.n_layers, cfg.d_conv)
    for layer_idx in range(min(2, cfg.n_layers)) if key not in CHECKED else ():
        with torch.random.fork_rng(devices=[]):
            mixer = ARCHS[cfg.arch](cfg, layer_idx)
        for L, cuts in ((32, torch.arange(32)), (MAX_LEN, torch.zeros(1, dtype=torch.long))):
            u, other = torch.randn(2, 1, L, cfg.d_model, generator=torch.Generator().manual_seed(0))
            keep = torch.arange(L)[None, :, None] <= cuts[:, None, None]  # row i keeps 0..cuts[i]
            with torch.no_grad():
                y = mixer(torch.cat([u, torch.where(keep, u, other)]))
            shape, want = tuple(getattr(y, "shape", ())) or type(y).__name__, (len(cuts) + 1, L, cfg.d_model)
            leak = [] if shape != want else (~torch.isclose(y[1:], y[:1].expand_as(y[1:]), rtol=1e-4,  # FFT roundoff
                                                            atol=1e-5 * y.abs().max().item()).all(-1)
                                             & keep[..., 0]).nonzero().tolist()  # [i, s]: row i moved s
            if shape != want or leak:
                broken = f"returned {shape} for an input of shape {want}" if shape != want else (
                    f"is not causal: its output at position {leak[0][1]} changed with its input after position "
                    f"{cuts[leak[0][0]]}")
                raise ConfigError(f"mixer '{cfg.arch}' {broken}; a mixer maps (B, L, d) to (B, L, d), causally")
    CHECKED.add(key)


def save_file(path, obj):
    """obj into path (JSON, text or torch.save) by a temporary file and a rename: a failed write loses nothing."""
    tmp = path + ".tmp"
    try:
        if path.endswith((".json", ".md")):
            with open(tmp, "w") as f:
                f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=1))
        else:
            torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        if os.path.isfile(tmp):
            os.remove(tmp)
        kept = "that file keeps what it held before" if os.path.isfile(path) else "nothing was written"
        raise ConfigError(f"cannot write {path} ({getattr(e, 'strerror', None) or type(e).__name__}); {kept}") from None


def load_file(path, need=("config",)):
    """The dict a file of this tool holds, with the keys `need`, else one ConfigError."""
    try:
        if path.endswith(".json"):
            with open(path) as f:
                obj = json.load(f)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # json and torch raise many kinds
        obj = e
    why = next((f"no '{k}'" for k in need if k not in obj), None) if isinstance(obj, dict) else type(obj).__name__
    statuses = ("running", "trained", "completed", "target reached", "nonfinite")
    why = why or obj.get("status", "running") not in statuses and f"status {obj['status']!r}"
    if why or not isinstance(obj.get("config", {}), dict):
        raise ConfigError(f"{path} is not a file this tool wrote or can read ({why or 'config'})")
    return obj


FILES = {"config.json": ("task", "arch"), "results.json": ("config", "status", "steps_done"),
         "model.pt": ("config", "vocab_size", "model")}  # in the order they are first written


def run_files(run_dir, cfg=None):
    """(cfg, {name: content}) of a folder's FILES, each this tool's, of cfg's settings (None: model.pt's, for --load)
    and, when training, none without one written before it; else one ConfigError."""
    at = lambda name: os.path.join(run_dir, name)
    got = {name: load_file(at(name), need) for name, need in FILES.items() if os.path.exists(at(name))}
    if cfg is None and "model.pt" not in got:
        raise ConfigError(f"no checkpoint at {at('model.pt')}; --load takes a run folder written by training")
    fix = "it holds files of two runs; move one away" if cfg is None else None
    if cfg is None:
        try:
            cfg = Config(**got["model.pt"]["config"])
        except TypeError as e:
            raise ConfigError(f"checkpoint {at('model.pt')} holds a config this version cannot read ({e})") from None
    elif list(got) != list(FILES)[:len(got)]:
        gap = next(name for name in FILES if name not in got)
        raise ConfigError(f"{run_dir} holds {' and '.join(got)} but no {gap}, written before them; move it away")
    for name, obj in got.items():
        same_settings(obj if name == "config.json" else obj["config"], cfg, at(name), fix)
    return cfg, got


def default_run_name(cfg):
    """The run folder's name when none is given: the settings a sweep or preset varies."""
    extra = f"_{cfg.atr_setting}" + ("" if cfg.atr_split == "iid" else f"_{cfg.atr_split}") if cfg.task == "atr" else ""
    extra += "" if cfg.atr_query == "parent" else f"_{cfg.atr_query}"
    extra += ("" if cfg.d_conv == "auto" else f"_c{cfg.d_conv}") + "_fixed" * (cfg.batch_order == "fixed")
    extra += ("" if cfg.pos_emb == "auto" else f"_pos_{cfg.pos_emb}") + f"_b{cfg.beta2:g}" * (cfg.beta2 != 0.999)
    return f"{cfg.task}{extra}_{cfg.arch}_d{cfg.d_model}_l{cfg.n_layers}_lr{cfg.lr:g}_s{cfg.seed}"


def same_settings(config, cfg, where, fix=None):
    """Refuse a saved config that differs from cfg in one of the Settings (one an older folder lacks counts as its
    default); where it runs and its folder's name may differ."""
    old = {f.name: config.get(f.name, f.default) for f in fields(Settings) if f.name not in ("device", "compile")}
    k = next((k for k in old if old[k] != getattr(cfg, k)), None)
    if k is not None:
        held = f"{k}={old[k]}" if k in config else f"no {k} (the default, {old[k]})"
        raise ConfigError(f"{where} holds a run with {held}, not {k}={getattr(cfg, k)}; "
                          f"{fix or 'give another --run_name or --out_dir, or move that folder away'}")


class Run:
    """A run's folder, out_dir/run_name: config.json, results.json and model.pt (a checkpoint at each evaluation,
    then the final weights); a cut run continues bit for bit."""

    def __init__(self, cfg, log=print):
        self.cfg, self.log, self.dir = cfg, log, os.path.join(cfg.out_dir, cfg.run_name)
        log("config: " + " ".join(f"{k}={v}" for k, v in asdict(cfg).items()))
        _, self.files = run_files(self.dir, cfg)
        self.results, self.ckpt = self.files.get("results.json", {}), self.files.get("model.pt")
        self.finished = (status := self.results.get("status")) in ("completed", "target reached")
        if status == "nonfinite":
            raise NonFiniteLoss(f"{self.dir} stopped on a non-finite loss after step {self.results['steps_done']} "
                                f"(lr={cfg.lr:g}); train another --lr, or move the folder away")
        if self.finished:
            log(f"{self.dir} finished ({status}) at step {self.results['steps_done']}; these are its results")
        elif self.ckpt is not None and "optimizer" not in self.ckpt and status != "trained":
            raise ConfigError(f"{self.path('model.pt')} holds final weights, results.json a cut run; move one away")

    def path(self, name):
        return os.path.join(self.dir, name)

    def begin(self, task, model, optimizer, scheduler, batches):
        """Before the loop: the folder, config.json and the checkpoint (or final weights); the steps done."""
        cfg, n_params, device = self.cfg, sum(p.numel() for p in model.parameters()), next(model.parameters()).device
        trained, saved = self.ckpt is not None and "optimizer" not in self.ckpt, self.results
        self.log(f"task {cfg.task}: {len(task.train):,} training and {len(task.eval):,} evaluation documents, "
                 f"{task.vocab_size:,} tokens")
        self.log(f"model {cfg.arch}: {n_params:,} parameters, d={cfg.d_model}, {cfg.n_layers} layers, device {device}")
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the run folder {self.dir} ({e.strerror})") from None
        save_file(self.path("config.json"), {**self.files.get("config.json", {}), **asdict(cfg)})  # and a user's
        self.task, self.model = task, model
        self.state = dict(model=model, optimizer=optimizer, scheduler=scheduler, batches=batches)
        self.results = {"config": asdict(cfg), "status": "running", "n_params": n_params, "steps_done": 0,
                        "history": [], "train_seconds": 0.0}
        if self.ckpt is not None:
            for name, obj in self.state.items() if not trained else [("model", model)]:
                try:
                    obj.load_state_dict(self.ckpt if name == "batches" else self.ckpt[name])
                except (KeyError, ValueError, RuntimeError, TypeError) as e:
                    raise ConfigError(f"{self.path('model.pt')} holds a {name} state that does not fit "
                                      f"({type(e).__name__}); move the folder away") from None
            self.log(f"resuming {self.dir} from its {'final weights' if trained else 'checkpoint'} at step "
                     f"{self.ckpt['step']:,} of {cfg.steps:,}")
            self.results = saved if trained else self.ckpt["results"]
        h, self.t_last = self.results["history"], time.time()
        return cfg.steps if trained or h and 0 < cfg.target_acc <= h[-1]["acc"] else self.results["steps_done"]

    def checkpoint(self, h, ev):
        """After an evaluation: h into the history, then results.json and model.pt, which the run resumes from; the
        seconds per step since the last one, which count as training time."""
        r, seconds = self.results, time.time() - self.t_last
        per_step, r["train_seconds"] = seconds / (h["step"] - r["steps_done"]), r["train_seconds"] + seconds
        r["history"].append(h)
        r.update(steps_done=h["step"], final_acc=ev["acc"], final_p_answer=ev["p_answer"])
        saved = {name: obj.state_dict() for name, obj in self.state.items() if name != "batches"}
        self.save(None, step=h["step"], **saved, **self.state["batches"].state_dict(), results=r)
        self.t_last = time.time()
        return per_step

    def end(self, ev):
        """After the loop: the final weights. The run is "trained" until fit adds the grid."""
        cfg, r = self.cfg, self.results
        r["ended"] = "target reached" if 0 < cfg.target_acc <= ev["acc"] else "completed"
        self.save("trained", step=r["steps_done"], model=self.model.state_dict())
        self.log(f"done ({r['ended']}) after {r['steps_done']:,} steps, {fmt_time(r['train_seconds'])} of training "
                 f"({r['ms_per_step']:.2f} ms/step) | eval acc {ev['acc']:.4f}, p(answer) {ev['p_answer']:.3f}")
        return r

    def save(self, status, **model_pt):
        """results.json (a status at the end), then with model_pt model.pt (checkpoint or weights)."""
        r = self.results
        if status:
            r.update(status=status, train_seconds=round(r["train_seconds"], 2),
                     ms_per_step=round(1000 * r["train_seconds"] / max(1, r["steps_done"]), 3))
        save_file(self.path("results.json"), r)
        if model_pt:  # if this fails, the last checkpoint stays
            save_file(self.path("model.pt"), {"config": asdict(self.cfg), "vocab_size":
                                              self.model.embed.num_embeddings, **model_pt})
        return r


def train(cfg, log=print):
    """fit the model of cfg in its run folder, which resumes a cut run and returns a finished one."""
    run = Run(cfg, log)  # refused: another run's files
    return run.results if run.finished else fit(cfg, run, log)


def load_run(run_dir, **expect):
    """(cfg, model) of a run folder; the settings given must match its own, but those of evaluation."""
    cfg, files = run_files(run_dir)
    evaluation = ("device", "n_eval", "analyze", "corrupt")  # --load may change these
    given = {k: getattr(replace(cfg, **{k: v}), k) for k, v in expect.items() if k in asdict(cfg)}  # lr=0: the default
    k = next((k for k in expect if k not in given or k not in evaluation and getattr(cfg, k) != given[k]), None)
    if k is not None:
        raise ConfigError(f"run {run_dir} was trained with {k}={getattr(cfg, k)}, not {k}={given[k]}; drop --{k}"
                          if k in given else f"{k} is not a setting of Config")
    cfg, ckpt = replace(cfg, **{k: v for k, v in expect.items() if k in evaluation}), files["model.pt"]
    model = build_model(cfg, ckpt["vocab_size"])
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # its last line names the parameter that does not fit
        why = str(e).strip().splitlines()[-1].strip()
        raise ConfigError(f"checkpoint {os.path.join(run_dir, 'model.pt')} does not fit a {cfg.arch} model with "
                          f"d_model={cfg.d_model} and n_layers={cfg.n_layers} ({why})") from None
    return cfg, model


# ----------------------------------------------------------------------------------------------------
# Experiments: learning-rate x width sweeps with best-run selection, as the paper reports its numbers.

PAPER_WIDTHS = (16, 32, 64, 128, 256)


def paper_lrs(task, arch):
    return (3e-5, 1e-4, 3e-4, 1e-3, 3e-3) + ((1e-2, 3e-2) if task == "ar" and arch != "attention" else ())


def sweep(base, widths=PAPER_WIDTHS, lrs=None, log=print, seeds=None):
    return run_sweeps(f"sweep {base.arch} on {base.task}", [(base.arch, base)], widths, lrs, base.out_dir, log, seeds)


def run_all(cfgs, log=print):
    """Train every config in turn; a run stopped by a NaN is a result too."""
    results = []
    for i, cfg in enumerate(cfgs):
        try:
            results.append(r := train(cfg, log=lambda s: None))
        except NonFiniteLoss:
            results.append(r := load_file(os.path.join(cfg.out_dir, cfg.run_name, "results.json")))
        log(f"  [{i + 1}/{len(cfgs)}] {cfg.run_name}: {r['status']}, acc {r.get('final_acc', 0.0):.4f}")
    return results


def best_rows(label, cfgs, results, widths):
    """Per width: the best rate on the mean over seeds, its seed_stats and its best seed's verdict."""
    rows = []
    for d in widths:
        by_lr = {}
        for cfg, r in zip(cfgs, results):
            if cfg.d_model == d:
                by_lr.setdefault(cfg.lr, []).append((cfg, r))
        stats = {lr: seed_stats([r for _, r in runs]) for lr, runs in by_lr.items()}
        lr = max(stats, key=lambda lr: (stats[lr]["acc"], stats[lr]["p_answer"]))
        cfg, best = max(by_lr[lr], key=lambda cr: (cr[1].get("final_acc", 0.0), cr[1].get("final_p_answer", 0.0)))
        rows.append({"label": label, "task": cfg.task, "arch": cfg.arch, "d_model": d, "best_lr": lr,
                     "n_params": best.get("n_params"),
                     "run": cfg.run_name, **stats[lr], "steps": best.get("steps_done"),
                     "verdict": verdict_text((best.get("mechanism") or {}).get("verdict"), numbers=False),
                     "train_seconds": best.get("train_seconds"),
                     "acc_by_lr": {f"{lr:g}": {k: v for k, v in s.items() if "attribution" not in k}
                                   for lr, s in stats.items()}})
    return rows


def seed_stats(runs):
    """One width and rate over seeds: the accuracy's mean, sample std, min and max (%), the seeds at 50 % or more,
    and the last layer's block_input attribution averaged over those (else over all)."""
    pct = lambda key: [100 * r.get(key, 0.0) for r in runs]
    acc = pct("final_acc")
    ok = [r for r, a in zip(runs, acc) if a >= 50] or runs

    def mean_reads(key):
        last = [g for mech in (r.get(key) for r in ok) if mech for g in mech["grid"]
                if g["site"] == "block_input" and g["layer"] == mech["n_layers"] - 1 and g["attribution"] is not None]
        values = {k: [g["attribution"] for g in last if g["position"] == k] for k in ("value", "key", "query")}
        return {k: np.mean(v).item() if v else None for k, v in values.items()}
    out = {"acc": np.mean(acc).item(), "acc_std": np.std(acc, ddof=1).item() if len(acc) > 1 else None,
           "acc_min": min(acc), "acc_max": max(acc), "n": len(acc), "successes": sum(a >= 50 for a in acc),
           "p_answer": np.mean([r.get("final_p_answer", 0.0) for r in runs]).item(),
           "attribution": mean_reads("mechanism")}
    if all("test_acc" in r for r in runs):
        out.update(test_acc=np.mean(pct("test_acc")).item(), test_attribution=mean_reads("mechanism_test"))
    return out


def md_table(header, rows):
    cell = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(map(cell, r)) + " |" for r in rows]


def save_summary(out_dir, title, rows, runs, log=print):
    """summary.json and summary.md (also logged): the best rate per width; dev -> test."""
    gen = [r for r in rows if "test_acc" in r]
    pm = lambda s: s["acc"] if s["acc_std"] is None else f"{s['acc']:.2f} ± {s['acc_std']:.2f}"
    spread = lambda s: (pm(s), f"{s['acc_min']:.2f}–{s['acc_max']:.2f}", f"{s['successes']}/{s['n']}")
    lines = [f"{title}: best learning rate per width (on the mean over seeds)", ""] + md_table(
        ("run", "d", "parameters", "best lr", "steps", "accuracy %", "min–max", "≥ 50 %", "value", "key",
         "query", "verdict"), [(r["label"], r["d_model"], f"{r.get('n_params') or 0:,}", f"{r['best_lr']:g}",
                               f"{r['steps'] or 0:,}", *spread(r),
                      *r["attribution"].values(), r["verdict"]) for r in rows])
    num = lambda v: "-" if v is None else f"{v:.2f}"
    lines += ["", "generalisation split: dev -> test", "", *md_table(
        ("run", "d", "dev %", "test %", "value", "key", "query"),
        [(r["label"], r["d_model"], r["acc"], r["test_acc"],
          *(f"{num(r['attribution'][k])} -> {num(r['test_attribution'][k])}" for k in ("value", "key", "query")))
         for r in gen])] if gen else []
    summary = {"title": title, "runs": runs, "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    save_file(os.path.join(out_dir, "summary.json"), summary)
    save_file(os.path.join(out_dir, "summary.md"), "\n".join(lines) + "\n")
    log("\n".join(lines))
    return summary


def run_sweeps(title, entries, widths, lrs, out_dir, log=print, seeds=None):
    """Sweep each (label, config) entry over widths x lrs (default: the paper's) x seeds; summarise in out_dir."""
    grids = [[replace(cfg, d_model=d, lr=lr, seed=seed, run_name="") for d in widths
              for lr in lrs or paper_lrs(cfg.task, cfg.arch) for seed in seeds or (cfg.seed,)] for _, cfg in entries]
    every = lambda name: sorted({getattr(c, name) for g in grids for c in g})
    summaries = [(out_dir, sum(grids, []))]  # and a preset's, per entry
    summaries += [(cfg.out_dir, g) for (_, cfg), g in zip(entries, grids) if cfg.out_dir != out_dir]
    runs = {f: [os.path.relpath(os.path.join(c.out_dir, c.run_name), f) for c in g] for f, g in summaries}
    for folder in runs:  # refused before any training
        twice = next((r for i, r in enumerate(runs[folder]) if r in runs[folder][:i]), None)
        path = os.path.join(folder, "summary.json")
        old = load_file(path, ("title", "runs", "rows")) if os.path.exists(path) else None
        if twice or (old["runs"] != runs[folder] if old else os.path.exists(path[:-4] + "md")):
            raise ConfigError(f"the grid names run {twice} twice (a name keeps 6 digits of lr); give each once"
                              if twice else
                              f"{folder} holds another summary; give another --out_dir")
    log(f"{title}: {len(entries)} sweep(s), {sum(map(len, grids))} runs, widths {list(widths)} x rates {every('lr')} "
        f"x seeds {every('seed')}, in {out_dir}")
    results, rows = run_all([c for g in grids for c in g], log), []
    for (label, cfg), grid in zip(entries, grids):
        res, results = results[:len(grid)], results[len(grid):]
        rows += best_rows(label, grid, res, widths)
        if cfg.out_dir != out_dir:
            save_summary(cfg.out_dir, label, rows[-len(widths):], runs[cfg.out_dir], log=lambda s: None)
    return save_summary(out_dir, title, rows, runs[out_dir], log)


def presets():
    """The paper's experiments as lists of (label, settings), each swept as run_preset says."""
    archs = list(ARCHS)
    return {
        "ar": [(a, dict(task="ar", arch=a)) for a in archs],
        **{f"atr_{s}": [(a, dict(task="atr", arch=a, atr_setting=s)) for a in archs] for s in ATR_SETTINGS},
        "mamba_conv": [(f"mamba_c{w}", dict(task="ar", arch="mamba", d_conv=w)) for w in "01234"],
        "atr_mamba_conv": [(f"mamba_c{w}", dict(task="atr", arch="mamba", d_conv=w)) for w in "01234"],
        "based_conv": [(f"based_c{w}", dict(task="ar", arch="based", d_conv=w)) for w in ("1", "2", "3", "4", "long")],
        "layers": [(f"{a}_{n}l", dict(task="ar", arch=a, n_layers=n)) for a in archs for n in (1, 3)],
        "pos_emb": [(f"{a}_pos_{p}", dict(task="ar", arch=a, pos_emb=p))  # App. D.1: the default flipped
                    for a, p in (("attention", "off"), ("mamba", "on"), ("based", "on"), ("hyena", "on"))],
        "atr_gen": [(a, dict(task="atr", arch=a, atr_split="gen")) for a in archs],
        "atr_sibling": [(f"{a}_{n}l", dict(task="atr", arch=a, atr_query="sibling", n_layers=n))  # App. D.4
                        for a, layers in (("mamba", (1, 2, 3)), ("attention", (1, 2, 3)), ("h3", (1, 2, 3)),
                                          ("based", (1,))) for n in layers],
        "seeds": [(a, dict(task="ar", arch=a)) for a in archs],
    }


def run_preset(name, args, widths=None, lrs=None, log=print, seeds=None):
    """Every sweep of a preset into out_dir/<label>/, over the widths, rates and seeds given, else the paper's."""
    table = presets()
    if name not in table:
        raise ConfigError(f"unknown preset '{name}'; allowed: {', '.join(table)}")
    clash = sorted({k for _, settings in table[name] for k, v in settings.items() if k in args and args[k] != v})
    if clash:  # a flag it overrides would be ignored
        raise ConfigError(f"preset {name} sets {', '.join(clash)} itself; leave out --{' and --'.join(clash)}")
    out_dir = Config(**args).out_dir
    widths, seeds = widths or PAPER_WIDTHS, seeds or ((0, 1, 2) if name == "seeds" else None)
    entries = [(label, Config(**{**args, **settings, "out_dir": os.path.join(out_dir, label), "run_name": ""}))
               for label, settings in table[name]]
    return run_sweeps(f"preset {name}", entries, widths, lrs, out_dir, log, seeds)


# ----------------------------------------------------------------------------------------------------
# Command line: one flag per Config field, plus --load.

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2
        print(f"error: {message}; see --help", file=sys.stderr)
        sys.exit(2)


def _numbers(kind):  # then checked as settings
    parse = lambda s: tuple(kind(v) for v in s.split(","))
    parse.__name__ = f"comma-separated {kind.__name__} list"  # named in argparse's error
    return parse


def parse_args(argv=None):
    p = _Parser(description="mecheval: train a small model on AR/ATR and evaluate how it recalls.")
    p._negative_number_matcher = re.compile(r"^-\.?\d")  # -1e-3 is a value
    for f in fields(Config):
        flag = dict(action=argparse.BooleanOptionalAction) if f.type is bool else dict(type=f.type)
        extra = f" [{', '.join(ARCHS)}]" if f.name == "arch" else ""
        p.add_argument(f"--{f.name}", **flag, default=argparse.SUPPRESS,
                       help=f"{f.metadata['help']}{extra} (default: {f.default})")
    widths = ",".join(map(str, PAPER_WIDTHS))
    for name, kind, help in (  # not Config fields
            ("load", dict(metavar="RUN"), "evaluate a saved run folder instead of training"),
            ("sweep", dict(action="store_true"), "train every width x learning rate, keep the best per width"),
            ("widths", dict(type=_numbers(int), metavar="D,D,..."), f"sweep widths (default: {widths})"),
            ("lrs", dict(type=_numbers(float), metavar="LR,LR,..."),
             "sweep learning rates, 0 = the arch's default (default: the paper's grid)"),
            ("seeds", dict(type=_numbers(int), metavar="S,S,..."),
             "sweep seeds (default: --seed; preset seeds: 0,1,2)"),
            ("preset", dict(metavar="NAME"), "run one of the paper's experiments as sweeps: " + ", ".join(presets()))):
        p.add_argument(f"--{name}", default=argparse.SUPPRESS, help=help, **kind)
    return vars(p.parse_args(argv))


def evaluate_run(run_dir, args, log=print):
    """--load: evaluate a saved run; --analyze draws its grid, saved if of the run's own settings."""
    draw = args.get("analyze", False)
    if "corrupt" in args and not draw:
        raise ConfigError("--corrupt applies to the grid, which --load draws with --analyze")
    cfg, model = load_run(run_dir, **args)
    model.to(setup(cfg))
    task = make_task(cfg, train=False)
    ev = evaluate(model, task.eval)
    log(f"{run_dir}: {cfg.arch} on {cfg.task}, eval acc {ev['acc']:.4f}, p(answer) {ev['p_answer']:.3f}")
    path, results = os.path.join(run_dir, "results.json"), run_files(run_dir)[1].get("results.json", {})
    if draw and results.get("status", "completed") not in ("completed", "target reached"):
        raise ConfigError(f"{run_dir} is unfinished ({results['status']}): its training command finishes it")
    found = analyze(model, task, cfg, {}, log, intervene=draw)
    own = all(results.get("config", {}).get(k, getattr(cfg, k)) == getattr(cfg, k) for k in ("corrupt", "n_eval"))
    if draw and own and results:  # else printed only
        save_file(path, {**results, **found})


def main(argv=None):
    args = parse_args(argv)
    grid = {k: args.pop(k) for k in ("widths", "lrs", "seeds") if k in args}
    flags = {k: args.pop(k) for k in ("sweep", "preset", "load") if k in args}
    try:
        if len(flags) > 1:  # one would be ignored
            raise ConfigError(f"--{' and --'.join(flags)} do not go together; give one")
        k = next((k for k in ("d_model", "lr", "run_name") if k in args and flags.keys() & {"sweep", "preset"}), None)
        if k or 0 < args.get("analyze_every", 0) > Config(**args).steps and "load" not in flags:
            raise ConfigError(f"--{min(flags)} sets each run's {k}; leave out --{k}" if k else
                              f"analyze_every={args['analyze_every']} is more than the steps")
        if "seed" in args and "seeds" in grid:
            raise ConfigError("--seeds gives the sweep's seeds; leave out --seed")
        if "preset" in flags:
            run_preset(flags["preset"], args, **grid)
        elif flags.get("sweep"):
            sweep(Config(**args), **grid)
        elif grid:
            raise ConfigError(f"--{min(grid)} belongs to a sweep; add --sweep or --preset")
        elif "load" in flags:
            evaluate_run(flags["load"], args)
        else:
            train(Config(**args))
    except (ConfigError, NonFiniteLoss) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except (MemoryError, RuntimeError, TypeError) as e:  # torch's allocators and sizes
        if not isinstance(e, MemoryError) and "alloc" not in str(e) and "verflow" not in str(e):
            raise
        sizes = "n_eval" if "load" in flags else "d_model, n_layers, n_keys, n_values, n_train or n_eval"
        print(f"error: the run does not fit in memory (a {type(e).__name__} while allocating); give a smaller "
              f"{sizes}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # each file is written whole (save_file) or not at all
        print("interrupted; saved files are kept; the same command resumes from a checkpoint, if any",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())