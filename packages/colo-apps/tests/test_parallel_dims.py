"""`ParallelDims` and the typed layout errors: the degrees resolve against the world size, and every refusal of a
layout (the plugin's support matrix, a plan's check) names the field to change in ``error.field``."""

import pytest

from colo.apps import Llama, get_preset
from colo.apps.booster import HybridParallel, LayoutError, ParallelDims, UnsupportedLayout
from colo.apps.booster.plans import find_plan


def test_dims_fill_in_dp_and_give_the_mesh_and_the_data_axes():
    dims = ParallelDims(tp=2, sp=2)
    assert dims.resolve(8).dp == 2 and dims.dp is None
    assert dims.mesh_shape(8) == {"pp": 1, "dp": 2, "sp": 2, "tp": 2}
    assert dims.data_axes() == ("dp", "sp") and ParallelDims(tp=2).data_axes() == ("dp",)
    assert HybridParallel(tp=2, dp=2).mesh_shape(4) == {"pp": 1, "dp": 2, "sp": 1, "tp": 2}


@pytest.mark.parametrize(
    ("dims", "world", "field", "words"),
    [
        (ParallelDims(tp=3), 4, "tp", "does not divide the world size 4"),
        (ParallelDims(tp=2, dp=4), 4, "dp", "dp=4 x tp=2 x pp=1 x sp=1 = 8 ranks, but the world size is 4"),
    ],
)
def test_sizes_that_do_not_fit_the_world_name_the_field(dims, world, field, words):
    with pytest.raises(LayoutError, match=words) as error:
        dims.resolve(world)
    assert error.value.field == field


@pytest.mark.parametrize(
    ("settings", "error_type", "field"),
    [
        ({"tp": 0}, LayoutError, "tp"),
        ({"tp": True}, LayoutError, "tp"),
        ({"dp": -1}, LayoutError, "dp"),
        ({"sp_mode": "zigzag"}, LayoutError, "sp_mode"),
        ({"sp": 2}, LayoutError, "sp_mode"),
        ({"sp_mode": "ring"}, LayoutError, "sp"),
        ({"zero_stage": 4}, LayoutError, "zero_stage"),
        (
            {
                "zero_stage": 3,
                "pp": 2,
                "num_microbatches": 2,
                "schedule": "zero_bubble_h1",
                "pipeline_zero_sync": "microbatch",
            },
            UnsupportedLayout,
            "pipeline_zero_sync",
        ),
        ({"zero_stage": 3, "activation_checkpointing": "selective"}, UnsupportedLayout, "activation_checkpointing"),
        (
            {"tp": 2, "sp_mode": "megatron", "pp": 2, "num_microbatches": 2, "schedule": "zero_bubble_h1"},
            UnsupportedLayout,
            "schedule",
        ),
        ({"schedule": "interleaved_1f1b", "pp": 2, "num_microbatches": 2}, LayoutError, "num_model_chunks"),
    ],
)
def test_the_support_matrix_raises_typed_errors_naming_the_field(settings, error_type, field):
    with pytest.raises(error_type) as error:
        HybridParallel(**settings)
    assert error.value.field == field and isinstance(error.value, ValueError)


def test_a_plan_refuses_more_stages_than_layers_naming_pp():
    model = Llama(get_preset("tiny"))  # 2 layers
    with pytest.raises(LayoutError, match="4 stages but the model has num_hidden_layers=2") as error:
        find_plan(model).check(model, HybridParallel(pp=4, num_microbatches=4))
    assert error.value.field == "pp"
