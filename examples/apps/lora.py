"""LoRA through peft on the native Llama, tensor-parallel over 2 ranks: only the adapters train, as in one process."""

import torch

from colo.apps import Booster, HybridParallel, Llama, get_preset
from colo.apps.lora import add_lora, merge_lora
from colo.comm import launch

IDS = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))  # the same batch on every rank


def make_model():
    model = Llama(get_preset("tiny"))
    model.init_weights(0)  # the pretrained base (here: seeded), the same on every rank
    add_lora(model, r=8, alpha=16)  # peft's LoRA layers on every projection; everything else frozen. A is drawn
    return model  # from seed=0 and each layer's name: the same on every rank and in one process, unseeded as here


def train(num_steps=3):
    model = make_model()
    booster = Booster(HybridParallel(tp=2, zero_stage=1))  # each adapter sharded like its base layer
    model, optimizer, *_ = booster.boost(
        model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    )
    losses = [booster.train_step({"input_ids": IDS, "labels": IDS}).loss for _ in range(num_steps)]

    model = booster.unwrap()  # parameters current
    with torch.no_grad():
        adapted = model(IDS, labels=IDS).loss
        merge_lora(model)  # W += (alpha / r) B A on every shard, wrappers replaced by their base layers
        merged = model(IDS, labels=IDS).loss
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-6)  # fp32 rounding of W + s B A
    assert not any("lora" in name for name, _ in model.named_parameters())
    return losses


if __name__ == "__main__":
    losses = launch(train, 2, backend="gloo")[0]  # 2 CPU processes
    reference = make_model()  # the same steps in one process
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for loss in losses:
        expected = reference(IDS, labels=IDS).loss
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(loss, expected.item(), rtol=1e-5, atol=0)  # vocab-parallel loss: another order
    assert losses[-1] < losses[0], losses
    print(f"ok: LoRA under tp=2, loss {losses[0]:.4f} -> {losses[-1]:.4f} as one process; merged, the same loss")
