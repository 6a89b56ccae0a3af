"""A 2-stage pipeline on 2 ranks under the zero-bubble ZB-H1 schedule, checked against the unsplit model."""

import torch
from torch import nn

from colo.comm import Mesh, launch
from colo.pipeline import PipelineExecutor, build_stages, partition_uniform, zero_bubble_h1


def train():
    mesh = Mesh(pp=2)
    torch.manual_seed(0)  # every rank builds the same model, keeps its stage
    embedding, head = nn.Embedding(64, 32), nn.Linear(32, 64)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)]
    tokens, targets = torch.randint(0, 64, (16,)), torch.randint(0, 64, (16,))

    whole = nn.Sequential(embedding, *blocks, head)  # the reference: the same modules, unsplit, one process
    expected_loss = nn.functional.cross_entropy(whole(tokens), targets)
    expected_loss.backward()
    expected = {param: param.grad.clone() for param in whole.parameters()}
    whole.zero_grad()

    schedule = zero_bubble_h1(num_ranks=2, num_microbatches=4)  # print(schedule.describe()) lists every action
    stages = build_stages(blocks, partition_uniform(len(blocks), schedule.num_stages), first=embedding, last=head)
    chunks = [stages[s] for s in schedule.stages[mesh.rank("pp")]]
    executor = PipelineExecutor(chunks, schedule=schedule, mesh=mesh, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD([p for chunk in chunks for p in chunk.parameters()], lr=0.1)
    result = executor.step(tokens, targets)  # grads in .grad; result.loss on every rank
    torch.testing.assert_close(result.loss, expected_loss.detach())
    for param in optimizer.param_groups[0]["params"]:  # microbatch losses are averaged: the whole batch's gradient
        torch.testing.assert_close(param.grad, expected[param])
    optimizer.step()
    optimizer.zero_grad()
    return result.loss.item(), len(result.actions)


if __name__ == "__main__":
    (loss, actions), _ = launch(train, 2, backend="gloo")  # 2 CPU processes; or torchrun + init_distributed()
    print(f"ok: ZB-H1 over pp=2, 4 microbatches, loss {loss:.4f}, {actions} actions on rank 0, gradients match")
