"""Checkpoints of FSDP2 FP8-weight models under torchrun, gloo (tests/torch/test_checkpoint.py).

Per case ``mode:recipe`` (2 ranks; weights of 384 / 300 (MXFP8: 288) / 256 rows, so shards cut
128-row tiles and 32-row blocks), with an FP8 model A trained for two steps and then saved
with torch.distributed.checkpoint (DCP) into ``$FP8BLK_CKPT_DIR``:

* ``get_model_state_dict(full_state_dict=True)`` gives those values (below) as full tensors;
* ``torch.save(model.state_dict())`` works, and every FP8 weight's local shard pickles as a
  plain tensor of its high-precision values (mode cast: the parameter's; mode primary: the FP8
  weight dequantized with its global scales);
* ``dcp.async_save`` (which deep-copies the weights to stage them) writes the same checkpoint;
* the DCP checkpoint loads into an unconverted, unsharded fp32 model: each weight equals the
  full parameter (cast) or ``fb.quantize(bf16(full master)).dequantize()`` (primary), bit for
  bit;
* a third FP8 model, sharded over a one-rank mesh on each rank, loads the checkpoint (DCP
  reshards it) and gives A's outputs; in mode primary its masters and optimizer state are
  A's ranks' concatenated;
* mode cast: a second FP8 model B (other weights, one forward already run, so its FP8 bytes
  were cast before) loads the model state and then gives A's outputs bit for bit (the load,
  which writes the local shards past the DTensor, makes the next all-gather re-cast);
* mode primary: B loads ``master_state_dict(B, masters, AdamW)`` (masters and optimizer state
  as DTensors), casts, and its next two steps give A's losses, outputs and masters bit for
  bit (the same arithmetic on the same state); loading the model state into B's FP8 primary
  weights fails with a message naming master_state_dict; master_state_dict refuses a wrong
  masters list, masters of another dtype and an optimizer that does not hold them.
* ``tp`` (4 ranks): FSDP2 x TP, see :func:`check_tp`.
Any failure raises; each rank prints "SUITE OK" at the end.
"""
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fp8blk as fb
from fp8blk.torch import Float8BlockConfig, convert_to_float8_block
from fp8blk.torch import fsdp as F
from fp8blk.torch.checkpoint import master_state_dict

from fsdp_worker import run_suite, spread, three_layers  # same folder
from tests.torch._parity import assert_same


def build(mode, recipe_name, seed, mesh):
    cfg = Float8BlockConfig() if recipe_name == "block2d" else Float8BlockConfig.mxfp8()
    dims = [256, 384, 300 if recipe_name == "block2d" else 288, 256]
    model = three_layers(dims, torch.Generator().manual_seed(seed))
    convert_to_float8_block(model, cfg)  # swaps the modules: take the new ones
    F.prepare_fsdp_fp8(model, mode=mode, model_dtype=torch.bfloat16)
    layers = [model[i] for i in (0, 2, 4)]
    for lin in layers:
        fully_shard(lin, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, layers, cfg.weight


def gathered(t):
    """The full tensor from every rank's (uneven) row shard, in rank order."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t.detach().cpu())
    return torch.cat(parts, 0)


def local(p):
    return p._local_tensor


class Trainer:
    def __init__(self, model, mode, data):
        self.model, self.mode, self.data = model, mode, data
        if mode == "primary":
            self.masters = F.master_weights(model)
            self.opt = torch.optim.AdamW(self.masters, lr=2.0 ** -9, weight_decay=0.01)
        else:
            self.opt = torch.optim.AdamW(model.parameters(), lr=2.0 ** -9, weight_decay=0.01)

    def step(self, i):
        x, t = self.data[i % len(self.data)]
        loss = (self.model(x) * t).sum()
        loss.backward()
        if self.mode == "primary":
            F.master_grads_(self.model, self.masters)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.mode == "primary":
            F.cast_master_weights_(self.model, self.masters)
        return loss.detach()


def check_reshard(mode, recipe_name, seed, path, x0, ya, ta, a_layers):
    """Load the 2-rank checkpoint into a model sharded over a ONE-rank mesh on each rank (DCP
    reshards): the same outputs as A's, and in mode primary the full masters and optimizer
    state of A's ranks, concatenated."""
    one = init_device_mesh("cpu", (dist.get_world_size(), 1),
                           mesh_dim_names=("replica", "shard"))["shard"]
    c, c_layers, _ = build(mode, recipe_name, seed + 11, one)
    tc = Trainer(c, mode, ta.data)
    if mode == "cast":
        dcp.load({"model": c.state_dict()}, checkpoint_id=path)
    else:
        dcp.load({"masters": master_state_dict(c, tc.masters, tc.opt)}, checkpoint_id=path)
        F.cast_master_weights_(c, tc.masters)
        for lin, m_a, m_c in zip(a_layers, ta.masters, tc.masters):
            cols = lin.in_features
            assert_same(m_c.detach().view(-1, cols), gathered(m_a.detach().view(-1, cols)),
                        "reshard: master")
            for k, v in ta.opt.state[m_a].items():
                want = v if v.dim() == 0 else gathered(v.view(-1, cols)).reshape(-1)
                assert_same(tc.opt.state[m_c][k], want, f"reshard: optimizer state {k}")
    with torch.no_grad():
        assert_same(c(x0), ya, "reshard: output")


def run_case(mode, recipe_name, seed, mesh, root):
    rank = dist.get_rank()
    path = os.path.join(root, f"{mode}-{recipe_name}")
    gen = torch.Generator().manual_seed(seed + 100 + rank)
    data = [(spread((32, 256), gen), spread((32, 256), gen, (1.0, 1.0))) for _ in range(4)]
    a, a_layers, recipe = build(mode, recipe_name, seed, mesh)
    ta = Trainer(a, mode, data)
    for i in range(2):
        ta.step(i)

    # what the checkpoint must hold, per weight: the full high-precision values
    if mode == "cast":
        want = [gathered(local(lin.weight).hp) for lin in a_layers]
    else:
        want = []
        for lin, m in zip(a_layers, ta.masters):
            full = gathered(m.detach().view(-1, lin.in_features))
            q = fb.quantize(full.to(torch.bfloat16).contiguous(), recipe, rowwise=True)
            want.append(q.dequantize(torch.float32))
    # a full (consolidated) state dict holds them too: DTensor.full_tensor's all-gather reads
    # the weights' values (mode primary: dequantized)
    full_sd = get_model_state_dict(a, options=StateDictOptions(full_state_dict=True))
    for i in range(len(a_layers)):
        assert_same(full_sd[f"{2 * i}.weight"], want[i], f"full state dict layer {i}")
    # torch.save: the local shards pickle as plain tensors of those values
    blob = os.path.join(path + f"-rank{rank}.pt")
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    torch.save(a.state_dict(), blob)
    loaded = torch.load(blob, weights_only=False)
    for i, lin in enumerate(a_layers):
        v = loaded[f"{2 * i}.weight"]
        v = v._local_tensor if hasattr(v, "_local_tensor") else v
        if type(v) is not torch.Tensor:
            raise AssertionError(f"torch.save stored a {type(v).__name__}, not a plain tensor")
        rows = list(torch.chunk(want[i], dist.get_world_size(), 0))
        assert_same(v, rows[rank] if rank < len(rows) else v[:0], f"torch.save layer {i}")

    if mode == "primary":
        for bad, why in (((ta.masters[:2], None), "master_weights"),
                         ((ta.masters, torch.optim.SGD([torch.zeros(1, requires_grad=True)])),
                          "does not hold every master"),
                         (([m.double() for m in ta.masters], None), "fp32")):
            try:
                master_state_dict(a, *bad)
            except ValueError as err:
                if why not in str(err):
                    raise
            else:
                raise AssertionError(f"master_state_dict accepted bad input ({why})")
        extra = {"masters": master_state_dict(a, ta.masters, ta.opt)}
    else:
        extra = {"optim": get_optimizer_state_dict(a, ta.opt)}
    dcp.save({"model": a.state_dict(), **extra}, checkpoint_id=path)
    # async_save stages a deep copy of the trained model's weights (FSDP2's objects, which
    # the weights' state refers to, refuse deepcopy): the same checkpoint
    dcp.async_save({"model": a.state_dict(), **extra}, checkpoint_id=path + "-async").result()
    dist.barrier()

    # an unconverted, unsharded model loads the checkpoint
    plain = torch.nn.Sequential(*[torch.nn.Linear(lin.in_features, lin.out_features, bias=False)
                                  for lin in a_layers])
    for where in (path, path + "-async"):
        sd = {f"{2 * i}.weight": lin.weight for i, lin in enumerate(plain)}
        dcp.load({"model": sd}, checkpoint_id=where)
        for i, lin in enumerate(plain):
            assert_same(lin.weight.detach(), want[i], f"plain model layer {i} ({where})")
            with torch.no_grad():
                lin.weight.zero_()

    x0 = data[0][0]
    with torch.no_grad():
        ya = a(x0)
    check_reshard(mode, recipe_name, seed, path, x0, ya, ta, a_layers)
    b, b_layers, _ = build(mode, recipe_name, seed + 7, mesh)
    tb = Trainer(b, mode, data)
    with torch.no_grad():
        yb0 = b(x0)  # B's FP8 bytes exist before the load (a stale cast would show)
    if torch.equal(yb0, ya):
        raise AssertionError("B gives A's outputs before loading: the check could not fail")
    if mode == "cast":
        # DCP loads in place (no load_state_dict after it): the writes reach the local
        # shards only, and the next all-gather must still re-cast
        dcp.load({"model": b.state_dict()}, checkpoint_id=path)
        with torch.no_grad():
            assert_same(b(x0), ya, "cast: B's output after loading")
        # (loading the optimizer state steps it with lr 0: that alone would re-cast)
        optim = {"optim": get_optimizer_state_dict(b, tb.opt)}
        dcp.load(optim, checkpoint_id=path)
        set_optimizer_state_dict(b, tb.opt, optim["optim"])
        for i in range(2, 4):
            assert_same(tb.step(i), ta.step(i), f"cast: step {i} loss")
        with torch.no_grad():
            assert_same(b(x0), a(x0), "cast: outputs after two more steps")
    else:
        try:
            dcp.load({"model": b.state_dict()}, checkpoint_id=path)
        except CheckpointException as err:  # every rank's exception, a BaseException
            if "master_state_dict" not in str(err):
                raise
        else:
            raise AssertionError("loading the model state into FP8 primary weights did not fail")
        dcp.load({"masters": master_state_dict(b, tb.masters, tb.opt)}, checkpoint_id=path)
        F.cast_master_weights_(b, tb.masters)
        for m_a, m_b in zip(ta.masters, tb.masters):
            assert_same(m_b.detach(), m_a.detach(), "primary: loaded master")
        for m_a, m_b in zip(ta.masters, tb.masters):
            for k, v in ta.opt.state[m_a].items():
                assert_same(tb.opt.state[m_b][k], v, f"primary: optimizer state {k}")
        with torch.no_grad():
            assert_same(b(x0), ya, "primary: B's output after loading")
        for i in range(2, 4):
            assert_same(tb.step(i), ta.step(i), f"primary: step {i} loss")
        for m_a, m_b in zip(ta.masters, tb.masters):
            assert_same(m_b.detach(), m_a.detach(), "primary: master after two more steps")
        with torch.no_grad():
            assert_same(b(x0), a(x0), "primary: outputs after two more steps")
    print(f"rank {rank}: checkpoint {mode}:{recipe_name} OK", flush=True)


def check_tp(ws, rank, seed, root):
    """FSDP2 x TP (a 2x2 (dp, tp) mesh; the FeedForward of tests/torch/_parity.py, w1/w2
    column-wise, out_proj row-wise, FP8 primary weights): master_state_dict saves after one
    AdamW step; a second model of the same layout loads it and gives the same outputs bit for bit, and a model
    under FSDP2 alone on the 4 ranks loads the same full masters and optimizer state (its
    outputs differ: with TP every tensor-parallel shard of a weight has its own tiles)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from tests.torch._parity import FeedForward, init_spread_

    path = os.path.join(root, "tp")

    def build_ffn(seed_, tp):
        model = FeedForward(256, 384, bias=False)
        init_spread_(model, torch.Generator().manual_seed(seed_))
        convert_to_float8_block(model, Float8BlockConfig())
        if tp:
            mesh2 = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
            dp = mesh2["dp"]
            parallelize_module(model, mesh2["tp"], {"w1": ColwiseParallel(),
                                                   "w2": ColwiseParallel(),
                                                   "out_proj": RowwiseParallel()})
        else:
            dp = init_device_mesh("cpu", (ws,))
        F.prepare_fsdp_fp8(model, mode="primary")
        for name in ("w1", "w2", "out_proj"):
            fully_shard(getattr(model, name), mesh=dp)
        fully_shard(model, mesh=dp)
        masters = F.master_weights(model)
        return model, masters, torch.optim.AdamW(masters, lr=2.0 ** -9)

    def full(sd):
        return {k: (v.full_tensor() if k.endswith("weight") else
                    {n: t.full_tensor() if hasattr(t, "full_tensor") else t
                     for n, t in v.items()}) for k, v in sd.items()}

    a, ma, oa = build_ffn(seed, True)
    x = spread((32, 256), torch.Generator().manual_seed(seed + 1 + rank // 2))  # per dp rank
    a(x).square().sum().backward()
    F.master_grads_(a, ma)
    oa.step()
    F.cast_master_weights_(a, ma)
    dcp.save({"masters": master_state_dict(a, ma, oa)}, checkpoint_id=path)
    with torch.no_grad():
        ya = a(x)
    want = full(master_state_dict(a, ma, oa))
    for tp in (True, False):
        b, mb, ob = build_ffn(seed + 5, tp)
        dcp.load({"masters": master_state_dict(b, mb, ob)}, checkpoint_id=path)
        F.cast_master_weights_(b, mb)
        got = full(master_state_dict(b, mb, ob))
        for k, v in want.items():
            if isinstance(v, dict):
                for n, t in v.items():
                    assert_same(torch.as_tensor(got[k][n]), torch.as_tensor(t), f"tp={tp}: {k} {n}")
            else:
                assert_same(got[k], v, f"tp={tp}: {k}")
        if tp:
            with torch.no_grad():
                assert_same(b(x), ya, "tp: output after loading")
    print(f"rank {rank}: checkpoint FSDP2 x TP OK", flush=True)


def case(spec, ws, rank, mesh, seed):
    if spec == "tp":
        check_tp(ws, rank, seed, os.environ["FP8BLK_CKPT_DIR"])
        return
    mode, recipe_name = spec.split(":")
    run_case(mode, recipe_name, seed, mesh, os.environ["FP8BLK_CKPT_DIR"])


if __name__ == "__main__":
    run_suite(case)
