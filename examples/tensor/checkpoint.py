"""Save a tensor-parallel model in the background on 2 ranks, load it into one process, export it for Hugging Face."""

import tempfile

import torch
from safetensors.torch import load_file
from torch import nn

from colo.comm import Mesh, launch
from colo.tensor import Colwise, Rowwise, parallelize
from colo.tensor.checkpoint import AsyncCheckpointer, export_hf, latest_checkpoint, load_checkpoint, verify_checkpoint


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


def train(root, num_steps=3):
    mesh = Mesh(tp=2)
    model = parallelize(make_model(), mesh=mesh, plan={"0": Colwise(), "2": Rowwise()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = AsyncCheckpointer(group=mesh.group("tp"))  # every rank, once: a gloo group of its own
    x = torch.ones(4, 16)
    for step in range(1, num_steps + 1):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        # returns after copying this rank's pieces (its shards; a replica once); a thread writes and commits them
        checkpointer.save(f"{root}/step-{step:08d}", dict(model.named_parameters()), metadata={"step": step})
    checkpointer.close()  # waits for the last save; a failed save raises here, at wait() or at the next save()
    return model(x).detach()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as root:
        outputs = launch(train, 2, root, backend="gloo")  # 2 CPU processes, tp=2: each saves its halves
        path = latest_checkpoint(root)
        report = verify_checkpoint(path)  # re-reads every piece and checks its CRC; raises if damaged
        model = make_model()  # one process, no tensor parallelism: the same checkpoint loads into any layout
        metadata, _ = load_checkpoint(path, {name: p.detach() for name, p in model.named_parameters()})
        torch.testing.assert_close(model(torch.ones(4, 16)), outputs[0])  # the trained tp=2 model, unsharded
        export_hf(path, f"{root}/hf-model", dtype=torch.bfloat16)  # model.safetensors (+ index when > 5GB)
        exported = load_file(f"{root}/hf-model/model.safetensors")
        assert torch.equal(exported["0.weight"], model[0].weight.detach().bfloat16())
    print(f"ok: step {metadata['step']}, {report.num_pieces} pieces saved by 2 tp ranks, loaded in 1 process, exported")
