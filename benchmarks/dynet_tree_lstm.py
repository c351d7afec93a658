"""The Tree-LSTM benchmark's model in DyNet, with on-the-fly autobatching.

Runs in its own environment (DyNet needs no torch; torch needs no DyNet)::

    python3 -m venv .venv-dynet && .venv-dynet/bin/pip install dynet38

``tree_lstm.py --dynet-python .venv-dynet/bin/python`` writes the PyTorch model's initial
weights (``.npz``) and the batches (JSON: per tree, post-order ``words``, ``left``, ``right``,
``labels``) and runs this script on them, so both frameworks start from the same weights and
see the same batches. Per update: a fresh graph, all trees of the batch, the mean softmax loss
over every node, one forward, one backward (DyNet batches same-shaped operations itself), one
Adam step (no gradient clipping, dense updates unless ``--sparse-updates``).

Two Tree-LSTM variants (``--model``), each written the way DyNet's own examples write one: one
``affine_transform`` per node for its gates, ``pick_range`` to take them apart:

* ``two-forget``: ``torchfold.examples.models.TreeLSTM``: the gates i, f_l, f_r, o, u of a node from
  one transform of both children's ``h``;
* ``shared-forget``: i, o, u from one transform of both children's ``h``, and each child's forget
  gate from its own ``h`` through one transform shared by both children (``f_k = σ(U_f h_k + b_f)``),
  as in DyNet's Tree-LSTM examples: DyNet batches the left and right forget transforms together.

After the warm-up updates it prints one JSON line (version, first batch's loss before any
update, warm-up losses), then runs one timed update per ``step`` line read from stdin,
answering each with a JSON line ``{"seconds": ..., "loss": ...}``, so that the caller can
interleave DyNet's updates with its own. Any other line (or end of input) ends the run; all
results are then written to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--weights", required=True, help=".npz of the PyTorch TreeLSTM's state_dict")
    parser.add_argument("--batches", required=True, help="JSON list of batches of flattened trees")
    parser.add_argument("--out", required=True, help="where to write the results (JSON)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--autobatch", type=int, default=1, help="DyNet autobatch strategy (0 = off)")
    parser.add_argument("--sparse-updates", action="store_true", help="update only the embeddings looked up")
    parser.add_argument("--mem", type=int, default=2048, help="DyNet memory pool, MB")
    parser.add_argument("--model", choices=["two-forget", "shared-forget"], default="two-forget")
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="elapsed or process CPU time"
    )
    args = parser.parse_args(argv)

    import dynet_config

    dynet_config.set(autobatch=args.autobatch, mem=args.mem, random_seed=1)
    import dynet as dy
    import numpy as np

    weights = np.load(args.weights)
    batches = json.loads(Path(args.batches).read_text(encoding="utf-8"))
    size = args.hidden

    pc = dy.ParameterCollection()
    embedding = pc.lookup_parameters_from_numpy(weights["embedding.weight"])
    leaf_w = pc.parameters_from_numpy(weights["leaf_gates.weight"])
    leaf_b = pc.parameters_from_numpy(weights["leaf_gates.bias"])
    node_w = pc.parameters_from_numpy(weights["node_gates.weight"])
    node_b = pc.parameters_from_numpy(weights["node_gates.bias"])
    out_w = pc.parameters_from_numpy(weights["classifier.weight"])
    out_b = pc.parameters_from_numpy(weights["classifier.bias"])
    shared = args.model == "shared-forget"
    if shared:
        forget_w = pc.parameters_from_numpy(weights["forget.weight"])
        forget_b = pc.parameters_from_numpy(weights["forget.bias"])
    trainer = dy.AdamTrainer(pc, alpha=args.lr, beta_1=0.9, beta_2=0.999, eps=1e-8)
    trainer.set_clip_threshold(0)  # DyNet clips gradients by default; PyTorch does not
    trainer.set_sparse_updates(args.sparse_updates)

    def batch_loss(batch: list[dict[str, list[int]]]) -> Any:
        dy.renew_cg()
        lw, lb, nw, nb, ow, ob = (dy.parameter(p) for p in (leaf_w, leaf_b, node_w, node_b, out_w, out_b))
        if shared:
            fw, fb = dy.parameter(forget_w), dy.parameter(forget_b)
        losses = []
        for tree in batch:
            words, left, right, labels = tree["words"], tree["left"], tree["right"], tree["labels"]
            hs: list[Any] = []
            cs: list[Any] = []
            for i, word in enumerate(words):
                if word >= 0:
                    gates = dy.affine_transform([lb, lw, dy.lookup(embedding, word)])
                    sig = dy.logistic(dy.pick_range(gates, 0, 2 * size))
                    c = dy.cmult(
                        dy.pick_range(sig, 0, size), dy.tanh(dy.pick_range(gates, 2 * size, 3 * size))
                    )
                    h = dy.cmult(dy.pick_range(sig, size, 2 * size), dy.tanh(c))
                elif shared:  # i, o, u from both children; each child's forget gate from its own h
                    gates = dy.affine_transform([nb, nw, dy.concatenate([hs[left[i]], hs[right[i]]])])
                    sig = dy.logistic(dy.pick_range(gates, 0, 2 * size))
                    f_left = dy.logistic(dy.affine_transform([fb, fw, hs[left[i]]]))
                    f_right = dy.logistic(dy.affine_transform([fb, fw, hs[right[i]]]))
                    c = (
                        dy.cmult(
                            dy.pick_range(sig, 0, size), dy.tanh(dy.pick_range(gates, 2 * size, 3 * size))
                        )
                        + dy.cmult(f_left, cs[left[i]])
                        + dy.cmult(f_right, cs[right[i]])
                    )
                    h = dy.cmult(dy.pick_range(sig, size, 2 * size), dy.tanh(c))
                else:
                    gates = dy.affine_transform([nb, nw, dy.concatenate([hs[left[i]], hs[right[i]]])])
                    sig = dy.logistic(dy.pick_range(gates, 0, 4 * size))
                    c = (
                        dy.cmult(
                            dy.pick_range(sig, 0, size), dy.tanh(dy.pick_range(gates, 4 * size, 5 * size))
                        )
                        + dy.cmult(dy.pick_range(sig, size, 2 * size), cs[left[i]])
                        + dy.cmult(dy.pick_range(sig, 2 * size, 3 * size), cs[right[i]])
                    )
                    h = dy.cmult(dy.pick_range(sig, 3 * size, 4 * size), dy.tanh(c))
                hs.append(h)
                cs.append(c)
                losses.append(dy.pickneglogsoftmax(dy.affine_transform([ob, ow, h]), labels[i]))
        return dy.esum(losses) / len(losses)

    def update(batch: list[dict[str, list[int]]]) -> float:
        loss = batch_loss(batch)
        value = loss.value()
        loss.backward()
        trainer.update()
        return float(value)

    first_loss = float(batch_loss(batches[0]).value())
    losses = []
    position = 0
    for _ in range(args.warmup):
        losses.append(update(batches[position % len(batches)]))
        position += 1
    version = f"dynet38 {importlib.metadata.version('dyNET38')} (dynet.__version__ {dy.__version__})"
    nodes = statistics.mean(sum(len(t["words"]) for t in b) for b in batches)
    header = {
        "version": version,
        "model": args.model,
        "first_loss": first_loss,
        "warmup_losses": losses,
        "nodes_per_batch": nodes,
    }
    # Serve timed updates on request, so that the caller can interleave them with its own.
    print(json.dumps(header), flush=True)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    times = []
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = clock()
        loss = update(batches[position % len(batches)])
        seconds = clock() - start
        position += 1
        times.append(seconds)
        losses.append(loss)
        print(json.dumps({"seconds": seconds, "loss": loss}), flush=True)
    result = {**header, "losses": losses, "seconds": times}
    Path(args.out).write_text(json.dumps(result), encoding="utf-8")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
