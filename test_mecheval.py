"""Tests for mecheval: tasks, model, training loop and command line. Quick on 2 CPU cores."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import mecheval as m

HERE = os.path.dirname(os.path.abspath(__file__))


def small_ar(**kw):
    base = dict(task="ar", n_pairs=5, n_keys=20, n_values=30, n_train=200, n_eval=64)
    return m.Config(**{**base, **kw})


def small_atr(**kw):
    return m.Config(**{**dict(task="atr", n_train=300, n_eval=100), **kw})


# ---------------------------------------------------------------------------------------------- AR

def check_ar_split(split, cfg):
    P, K, V = cfg.n_pairs, cfg.n_keys, cfg.n_values
    ids, N = split.input_ids, len(split)
    assert ids.shape == (N, 2 * P + 5) and (split.lengths == 2 * P + 5).all()
    assert (ids[:, 0] == m.BOS).all() and (ids[:, 2 * P + 1] == m.EOS).all() and (ids[:, -1] == m.EOS).all()
    keys, vals = ids[:, 1:2 * P + 1:2], ids[:, 2:2 * P + 2:2]
    assert ((keys >= 3) & (keys < 3 + K)).all() and ((vals >= 3 + K) & (vals < 3 + K + V)).all()
    for row in range(N):  # distinct keys and distinct values within a document
        assert len(set(keys[row].tolist())) == P and len(set(vals[row].tolist())) == P
    rows, pos = torch.arange(N), split.pos
    i = (pos["key"] - 1) // 2                                     # the queried pair
    assert (pos["key"] == 1 + 2 * i).all() and (pos["value"] == 2 + 2 * i).all()
    assert ((pos["next_key"] == 3 + 2 * i) | ((pos["next_key"] == -1) & (i == P - 1))).all()
    assert (pos["divider"] == 2 * P + 1).all() and (pos["query"] == 2 * P + 2).all()
    assert (pos["answer"] == 2 * P + 3).all()
    query, answer = ids[rows, pos["query"]], ids[rows, pos["answer"]]
    assert (ids[rows, pos["key"]] == query).all(), "the query is the key in context"
    assert (ids[rows, pos["value"]] == answer).all(), "the answer is that key's value"
    assert ((keys == query[:, None]).sum(1) == 1).all(), "the query occurs exactly once in context"
    expected = torch.full_like(ids, -100)
    expected[rows, pos["query"]] = answer
    assert torch.equal(split.labels, expected), "only the answer is labelled, at the query position"


def test_ar_layout_and_positions():
    cfg = small_ar()
    task = m.make_task(cfg)
    assert task.vocab_size == 3 + 20 + 30
    check_ar_split(task.train, cfg)
    check_ar_split(task.eval, cfg)
    i = (task.train.pos["key"] - 1) // 2
    assert set(i.tolist()) == set(range(cfg.n_pairs)), "every pair gets queried"


def test_ar_paper_defaults():
    cfg = m.Config(n_train=64, n_eval=32)
    task = m.make_task(cfg)
    assert task.vocab_size == 8195 and task.train.input_ids.shape == (64, 37)
    assert cfg.n_pairs == 16 and cfg.steps == 50_016 and cfg.batch_size == 32
    assert m.Config().n_train == 100_032 and m.Config().n_eval == 320
    check_ar_split(task.train, cfg)


def test_ar_dense_vocab_uses_exact_sampler():
    cfg = small_ar(n_pairs=8, n_keys=8, n_values=9)  # every key in every document
    check_ar_split(m.make_task(cfg).train, cfg)


# ---------------------------------------------------------------------------------------------- ATR

class Node:
    """The test's own derivation tree: a nonterminal with its children and its head leaf."""

    def __init__(self, children, head):
        self.children, self.head = children, head


def replay_tree(grammar, r):
    """Rebuild the derivation of one sentence with the test's own tree code, drawing from r in the
    documented order (start symbol, then per expansion: the rule, the body left to right, the head)."""
    def expand(x):
        rule = grammar.rules[x][m.Grammar._pick(r, grammar.rule_cum[x])]
        children = [("leaf", s) if s >= 0 else expand(-s - 1) for s in rule]
        return Node(children, ("leaf", m.Grammar._pick(r, grammar.head_cum[x])))
    return expand(r.randrange(len(grammar.rules)))


def tree_yield_and_parents(root):
    """Walk the tree: leaves in order, and for each leaf the index of its parent (-1 for the root head)."""
    leaves, parent_of = [], {}

    def walk(node):  # returns the index of node's head leaf
        kids = []
        for ch in node.children:
            if isinstance(ch, Node):
                kids.append(walk(ch))
            else:
                leaves.append(ch[1])
                kids.append(len(leaves) - 1)
        leaves.append(node.head[1])
        for k in kids:
            parent_of[k] = len(leaves) - 1
        return len(leaves) - 1

    walk(root)
    return leaves, [parent_of.get(i, -1) for i in range(len(leaves))]


def atr_grammar(cfg):
    max_rhs, n_terminals = m.ATR_SETTINGS[cfg.atr_setting]
    return m.Grammar(m.np.random.default_rng([cfg.seed, 2]), n_terminals, max_rhs)


@pytest.mark.parametrize("setting", ["easy", "medium", "8192"])
def test_atr_against_independent_trees(setting):
    cfg = small_atr(atr_setting=setting, n_train=150, n_eval=20)
    task = m.make_task(cfg)
    grammar = atr_grammar(cfg)
    n_terminals = m.ATR_SETTINGS[setting][1]
    assert task.vocab_size == 3 + n_terminals
    split, ids, pos = task.train, task.train.input_ids, task.train.pos
    for n in range(len(split)):
        r = random.Random(f"{cfg.seed}/train/{n}")
        while True:  # replay the draws, rejecting as documented, until the accepted sentence
            leaves, parents = tree_yield_and_parents(replay_tree(grammar, r))
            last = {t: i for i, t in enumerate(leaves)}
            if 3 <= len(leaves) <= m.MAX_LEN - 5 and any(parents[i] >= 0 for i in last.values()):
                break
        L = len(leaves)
        assert ids[n, 1:L + 1].tolist() == [t + 3 for t in leaves], "the yield matches the rebuilt tree"
        assert ids[n, 0] == m.BOS and ids[n, L + 1] == m.EOS and ids[n, L + 4] == m.EOS
        assert split.lengths[n] == L + 5 and (ids[n, L + 5:] == m.PAD).all()
        c, p = int(pos["key"][n]) - 1, int(pos["value"][n]) - 1
        assert parents[c] == p, "value is the parent of key in the rebuilt tree"
        assert p > c, "the parent lies to the right of the child"
        assert last[leaves[c]] == c, "the queried child is the rightmost of its type"
        assert ids[n, pos["query"][n]] == leaves[c] + 3 and ids[n, pos["answer"][n]] == leaves[p] + 3
        assert pos["next_key"][n] == pos["key"][n] + 1 and pos["divider"][n] == L + 1
        assert pos["query"][n] == L + 2 and pos["answer"][n] == L + 3
        labelled = (split.labels[n] != -100).nonzero()[:, 0].tolist()
        assert labelled == [L + 2] and split.labels[n, L + 2] == leaves[p] + 3
    lengths = split.lengths - 5
    assert lengths.min() >= 3 and lengths.max() <= m.MAX_LEN - 5


def test_atr_tree_statistics_easy():
    task = m.make_task(small_atr(n_train=3000, n_eval=10))
    dist = (task.train.pos["value"] - task.train.pos["key"]).float().mean().item()
    assert 1.5 < dist < 4.0, f"mean child->parent distance {dist} far from the paper's ~2.4"
    assert 5 < (task.train.lengths - 5).float().mean() < 25


@pytest.mark.parametrize("which", ["dev", "test"])
def test_atr_generalisation_split(which):
    task = m.make_task(small_atr(atr_split=which, n_train=400, n_eval=100))
    held = task.heldout
    assert 0.1 < held.float().mean() < 0.3

    def pairs(split):
        rows = torch.arange(len(split))
        parent = split.input_ids[rows, split.pos["value"]] - 3
        child = split.input_ids[rows, split.pos["key"]] - 3
        return held[parent, child]

    assert not pairs(task.train).any(), "training queries never use a held-out pair"
    if which == "dev":
        assert not pairs(task.eval).any()
    else:
        assert pairs(task.eval).all(), "test queries use held-out pairs only"
    dev = m.make_task(small_atr(atr_split="dev", n_train=400, n_eval=100))
    assert torch.equal(dev.train.input_ids, task.train.input_ids), "dev and test share the training set"


# ------------------------------------------------------------------------------------- determinism

def test_same_seed_same_data_other_seed_other_data():
    for make in (small_ar, small_atr):
        a, b, c = m.make_task(make(seed=3)), m.make_task(make(seed=3)), m.make_task(make(seed=4))
        assert torch.equal(a.train.input_ids, b.train.input_ids) and torch.equal(a.eval.labels, b.eval.labels)
        assert not torch.equal(a.eval.input_ids[:, :5], c.eval.input_ids[:, :5])
    for make in (small_ar, small_atr):
        big, small = m.make_task(make(seed=3, n_train=500)), m.make_task(make(seed=3))
        assert torch.equal(big.eval.input_ids, small.eval.input_ids), "eval data does not depend on n_train"


def test_same_seed_same_first_losses(tmp_path):
    def losses(seed):
        cfg = small_ar(seed=seed, steps=3, eval_every=1, target_acc=0, out_dir=str(tmp_path),
                       run_name=f"s{seed}_{random.random()}")
        return [h["loss"] for h in m.train(cfg, log=lambda s: None)["history"]]
    first = losses(0)
    assert first == losses(0)
    assert first != losses(1)


# ----------------------------------------------------------------------------------------------- model

def test_attention_fast_equals_reference_outputs_and_grads():
    torch.manual_seed(0)
    att = m.Attention(m.Config(d_model=16), 0)
    for T in (1, 7, 37):
        x = torch.randn(3, T, 16, requires_grad=True)
        gy = torch.randn(3, T, 16)
        outs = []
        for ref in (False, True):
            att.reference = ref
            x.grad = None
            att.zero_grad()
            y = att(x)
            y.backward(gy)
            outs.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in att.parameters()]))
        att.reference = False
        (y0, gx0, gp0), (y1, gx1, gp1) = outs
        torch.testing.assert_close(y0, y1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx0, gx1, rtol=1e-5, atol=1e-6)
        for a, b in zip(gp0, gp1):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_model_is_causal_and_shapes():
    cfg = small_ar(d_model=32)
    model = m.build_model(cfg, 53)
    ids = torch.randint(3, 53, (2, 15))
    logits = model(ids)
    assert logits.shape == (2, 15, 53)
    for t in (0, 6, 14):
        ids2 = ids.clone()
        ids2[:, t] = (ids2[:, t] + 1 - 3) % 50 + 3
        logits2 = model(ids2)
        assert torch.equal(logits[:, :t], logits2[:, :t]), f"changing token {t} changed earlier logits"
        assert not torch.allclose(logits[:, t], logits2[:, t])


def test_parameter_counts_and_init():
    cfg = m.Config(d_model=64)
    model = m.build_model(cfg, 8196)  # archs.md §10 counts with V = 8196
    assert sum(p.numel() for p in model.blocks[0].mixer.parameters()) == 16_448
    assert sum(p.numel() for p in model.blocks.parameters()) == 99_584
    assert sum(p.numel() for p in model.parameters()) == 689_792
    assert model.pos_emb is not None and m.build_model(m.Config(pos_emb="off"), 10).pos_emb is None
    w = model.blocks[0].mixer.out_proj.weight
    assert abs(w.std().item() - 0.01) < 0.001, "out_proj is N(0, 0.02/sqrt(2*n_layers))"
    assert abs(model.blocks[0].mixer.Wqkv.weight.std().item() - 0.02) < 0.001
    assert (model.blocks[0].mixer.out_proj.bias == 0).all()
    assert torch.equal(m.build_model(cfg, 50).embed.weight, m.build_model(cfg, 50).embed.weight)


def test_lr_schedule_warmup_then_cosine_to_zero():
    f = [m.lr_factor(s, 10, 100) for s in range(101)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.5, abs=1e-6) and f[100] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


# -------------------------------------------------------------------------------------------- learning

def test_attention_learns_small_ar(tmp_path):
    cfg = m.Config(n_pairs=2, n_keys=16, n_values=16, n_train=20_000, batch_size=64, steps=4000,
                   lr=1e-3, eval_every=250, target_acc=0.95, out_dir=str(tmp_path))
    res = m.train(cfg, log=lambda s: None)
    assert res["final_acc"] >= 0.95, res["history"][-3:]
    assert res["status"] == "target reached"


# ------------------------------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("argv, words", [
    (["--arch", "transformer"], ["arch", "transformer", "attention"]),
    (["--task", "mqar"], ["task", "mqar", "ar, atr"]),
    (["--d_model", "0"], ["d_model", "0"]),
    (["--n_pairs", "40", "--n_keys", "30"], ["n_pairs=40", "n_keys=30"]),
    (["--atr_setting", "hard", "--task", "atr"], ["atr_setting", "hard", "easy, medium, 8192"]),
    (["--atr_split", "test"], ["atr_split", "task=ar"]),
    (["--batch_size", "64", "--n_train", "10"], ["batch_size=64", "n_train=10"]),
    (["--lr", "-1"], ["lr", "-1"]),
])
def test_cli_rejects_bad_values(argv, words, capsys, tmp_path):
    assert m.main(argv + ["--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    for w in words:
        assert w in err
    assert not os.listdir(tmp_path), "nothing is written for a rejected config"


def test_cli_bad_type_exits_2_without_traceback():
    out = subprocess.run([sys.executable, os.path.join(HERE, "mecheval.py"), "--d_model", "big"],
                         capture_output=True, text=True, cwd=HERE)
    assert out.returncode == 2
    assert "--d_model" in out.stderr and "big" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


TINY = ["--n_pairs", "3", "--n_keys", "10", "--n_values", "10", "--n_train", "200", "--n_eval", "50",
        "--d_model", "16", "--steps", "30", "--eval_every", "10"]


def test_cli_end_to_end_and_load_round_trip(tmp_path, capsys):
    assert m.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "tiny"]) == 0
    run = tmp_path / "tiny"
    cfg = json.loads((run / "config.json").read_text())
    res = json.loads((run / "results.json").read_text())
    assert cfg["d_model"] == 16 and cfg["lr"] == m.DEFAULT_LR["attention"] and cfg["steps"] == 30
    assert res["status"] == "completed" and res["steps_done"] == 30 and len(res["history"]) == 3
    assert res["n_params"] > 0 and "final_acc" in res and res["wrong_examples"]
    out = capsys.readouterr().out
    assert "step     10/30" in out and "ms/step" in out and "wrong:" in out
    assert m.main(["--load", str(run)]) == 0
    assert f"eval acc {res['final_acc']:.4f}" in capsys.readouterr().out
    cfg2, model = m.load_run(str(run))
    assert m.evaluate(model, m.make_task(cfg2, train=False).eval)["acc"] == res["final_acc"]


def test_cli_load_refuses_mismatch(tmp_path, capsys):
    assert m.main(TINY + ["--out_dir", str(tmp_path), "--run_name", "tiny"]) == 0
    run = str(tmp_path / "tiny")
    capsys.readouterr()
    assert m.main(["--load", run, "--d_model", "32"]) == 2
    err = capsys.readouterr().err
    assert "d_model=16" in err and "d_model=32" in err
    assert m.main(["--load", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    ckpt = torch.load(os.path.join(run, "model.pt"), weights_only=True)
    ckpt["config"]["d_model"] = 24  # a checkpoint whose weights do not fit its config
    torch.save(ckpt, os.path.join(run, "model.pt"))
    assert m.main(["--load", run]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit" in err and "d_model=24" in err and "\n" not in err


def test_nan_loss_stops_with_message_and_keeps_files(tmp_path, capsys):
    argv = TINY + ["--lr", "1e30", "--out_dir", str(tmp_path), "--run_name", "nan"]
    assert m.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the training loss became") and "lr=1e+30" in err and "\n" not in err
    res = json.loads((tmp_path / "nan" / "results.json").read_text())
    assert res["status"] == "nonfinite" and (tmp_path / "nan" / "config.json").exists()


def test_device_auto():
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert m.pick_device("auto") == expected
