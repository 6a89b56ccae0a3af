"""Activation checkpointing applied from outside the model: every mode gives the gradients of no checkpointing."""

import copy

import torch

from colo.apps import DDP, Booster, Llama, apply_activation_checkpointing, get_preset

device = "cuda" if torch.cuda.is_available() else "cpu"
# the same ops recomputed on the same inputs: bit-identical on CPU; GPU kernels may sum in another order
tolerance = 0.0 if device == "cpu" else 1e-5


def gradients(model, ids):
    model(ids, labels=ids).loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}


model = Llama(get_preset("tiny", num_hidden_layers=4))
model.init_weights(0)
model.to(device)
ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
expected = gradients(copy.deepcopy(model), ids)
for mode in ["full", "selective", "offload"]:
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed, mode=mode, every=1)  # after parallelization, before torch.compile
    for name, grad in gradients(checkpointed, ids).items():
        torch.testing.assert_close(grad, expected[name], rtol=tolerance, atol=tolerance, msg=f"{mode}: {name}")

# or let a plugin apply it (after parallelization, before compile_blocks); here DDP in this one process
booster = Booster(DDP(activation_checkpointing="full", activation_checkpointing_every=2))
booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
loss = booster.train_step({"input_ids": ids, "labels": ids}).loss
print(f"ok: full, selective and offload checkpointing give the same gradients on {device}; DDP step loss {loss:.4f}")
