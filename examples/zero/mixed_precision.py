"""ZeRO stage 2 on 2 data-parallel ranks: bf16 compute, fp32 masters, weight-decay groups, accumulation, clipping."""

import torch
from torch import nn

from colo.comm import Mesh, launch
from colo.zero import MixedPrecision, ZeroOptimizer


def train(num_steps=3, num_micro_batches=2):
    mesh = Mesh(dp=2)
    torch.manual_seed(0)  # build every replica with the same seed: each rank keeps its slice of the fp32 masters
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    param_groups = [
        {"params": [p for name, p in model.named_parameters() if name.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for name, p in model.named_parameters() if name.endswith("bias")], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(param_groups, lr=1e-2)  # any torch optimizer; groups keep lr / wd
    zero = ZeroOptimizer(
        model,
        optimizer,
        mesh=mesh,
        stage=2,  # or config=ZeroConfig(...)
        data_axes=("dp",),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
    )
    data = torch.Generator().manual_seed(mesh.rank("dp"))  # this rank's rows
    micro_batches = [torch.randn(8, 32, generator=data) for _ in range(num_micro_batches)]
    losses = []
    for _ in range(num_steps):
        step_loss = 0.0
        for x in micro_batches:
            # the parameters are bf16 now: cast the inputs to param_dtype (fp32 inputs fail in the first matmul)
            prediction = model(x.to(torch.bfloat16)).float()
            loss = (prediction - x.sum(dim=1, keepdim=True)).square().mean()  # the loss in fp32
            zero.backward(loss / len(micro_batches))
            step_loss += loss.item() / len(micro_batches)
        zero.clip_grad_norm_(1.0)
        skipped = zero.step()  # True when the fp16 loss scaler skipped the step (never with bf16)
        zero.zero_grad()
        assert not skipped
        losses.append(step_loss)
    zero.wait_params()  # the all-gather of the updated parameters overlaps the next forward: wait to read them
    return losses, torch.cat([p.detach().float().flatten() for p in model.parameters()])


if __name__ == "__main__":
    (losses, params), (_, params_1) = launch(train, 2, backend="gloo")  # 2 CPU processes
    assert torch.equal(params, params_1), "the replicas diverged"
    assert losses[-1] < losses[0], losses
    print(f"ok: ZeRO-2 bf16 on dp=2, loss {losses[0]:.3f} -> {losses[-1]:.3f}, replicas equal")
