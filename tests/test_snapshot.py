"""Evidence on demand in the job: a snapshot command is answered at a step boundary, bounded in size."""

from __future__ import annotations

import time

import torch
from torch import nn

import probes
from schemas.events import TensorSnapshot


def test_snapshot_command_gives_bounded_slices_of_parameters_and_activations(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 300), nn.ReLU(), nn.Linear(300, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = probes.MemorySink()
    probe = probes.attach(model, opt, run="snap", sink=sink, interval=5, spool_dir=tmp_path, flush_interval=0.01)
    sink.commands = [{"fix_id": "s-1", "op": "snapshot",
                      "params": {"tensors": ["0.weight", "1", "<input>", "no.such"], "max_elements": 100000}}]
    for step in range(12):
        x = torch.randn(16, 4)
        if step == 8:
            x[2, 1] = float("nan")
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        time.sleep(0.02)  # let the command ride back on a reply
    probe.close()
    (ev,) = [e for e in sink.events if e["kind"] == "tensor_snapshot"]
    snap = TensorSnapshot.model_validate(ev)
    got = {(t.name, t.source): t for t in snap.tensors}
    assert set(got) == {("0.weight", "parameter"), ("0.weight", "gradient"), ("<input>", "activation"),
                        ("1", "activation")}
    assert got["1", "activation"].shape == [16, 300] and got["1", "activation"].numel == 4800
    assert all(len(t.values) <= 256 for t in snap.tensors)  # the job's bound, whatever the server asks
    assert got["0.weight", "parameter"].dtype == "float32"
    assert snap.missing == ["no.such"]
    # Asked once, answered once, hooks gone: the rest of the run is unaffected.
    assert not model._forward_hooks and not model[1]._forward_hooks


def test_a_sparse_gradient_is_sliced_as_its_dense_layout_at_its_rows(tmp_path):
    """An embedding with sparse gradients (SparseAdam's): the snapshot has its gradient, where its looked-up
    rows are, the same values as the dense gradient there; the NaN it holds is where the slice is centred."""
    torch.manual_seed(0)
    table = nn.Embedding(100_000, 8, sparse=True)
    opt = torch.optim.SparseAdam(table.parameters(), lr=1e-2)
    sink = probes.MemorySink()
    probe = probes.attach(table, opt, run="snap-sparse", sink=sink, interval=5, spool_dir=tmp_path,
                          flush_interval=0.01)
    sink.commands = [{"fix_id": "s-2", "op": "snapshot", "params": {"tensors": ["weight"], "max_elements": 64}}]
    dense = None
    for _ in range(6):
        ids = torch.tensor([70_000, 5, 70_000])
        out = table(ids)
        opt.zero_grad()
        (out * torch.tensor([1.0, 2.0, float("nan")])[:, None]).sum().backward()
        dense = table.weight.grad.to_dense().reshape(-1)
        opt.step()
        probe.step()
        time.sleep(0.02)
    probe.close()
    (ev,) = [e for e in sink.events if e["kind"] == "tensor_snapshot"]
    got = {(t.name, t.source): t for t in TensorSnapshot.model_validate(ev).tensors}
    grad = got["weight", "gradient"]
    assert grad.shape == [100_000, 8] and grad.numel == 800_000
    assert grad.nan_count == 8 and grad.offset == 70_000 * 8 - 32  # centred on row 70000, its first NaN
    want = dense[grad.offset:grad.offset + 64].tolist()
    assert grad.values == [None if v != v else v for v in want]
