"""Error codes, their HTTP mapping, and API model validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError as PydanticValidationError

from gpuclusters.core import errors as e
from gpuclusters.core.models import ClusterCreate, ClusterUpdate, check_name
from gpuclusters.server.errors import status_for


@pytest.mark.parametrize(
    ("exc", "code", "status"),
    [
        (e.ValidationError("x"), "invalid_input", 422),
        (e.AuthenticationError("x"), "unauthenticated", 401),
        (e.PermissionDeniedError("x"), "forbidden", 403),
        (e.NotFoundError("x"), "not_found", 404),
        (e.AlreadyExistsError("x"), "already_exists", 409),
        (e.InvalidStateError("x"), "invalid_state", 409),
        (e.CapacityUnavailableError("x"), "capacity_unavailable", 409),
        (e.ServerError("x"), "internal", 500),
    ],
)
def test_codes_and_statuses(exc: e.GpuClustersError, code: str, status: int) -> None:
    assert exc.code == code
    assert status_for(exc) == status
    back = e.error_from_dict(exc.to_dict())
    assert type(back) is type(exc) and back.message == "x"


def test_unknown_code_survives_round_trip() -> None:
    err = e.error_from_dict({"code": "brand_new", "message": "m", "field": "f"})
    assert err.code == "brand_new" and err.field == "f"


@pytest.mark.parametrize("name", ["a", "demo", "my-cluster-2", "x" * 40])
def test_good_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "-a", "a-", "A", "1abc", "a_b", "x" * 41, "a.b"])
def test_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="lowercase"):
        check_name(name)


def test_cluster_create_rules() -> None:
    ok = ClusterCreate(name="c", cluster_type="slurm", num_gpus=16)  # type: ignore[arg-type]
    assert ok.billing_type.value == "on_demand" and ok.num_preemptible_gpus == 0
    with pytest.raises(PydanticValidationError, match="either an existing volume"):
        ClusterCreate(name="c", cluster_type="slurm", num_gpus=8, volume="v", volume_size_tib=2)  # type: ignore[arg-type]
    with pytest.raises(PydanticValidationError, match="must be after"):
        ClusterCreate(
            name="c",
            cluster_type="slurm",  # type: ignore[arg-type]
            num_gpus=8,
            billing_type="scheduled_capacity",  # type: ignore[arg-type]
            reservation_start="2027-02-01T00:00:00Z",  # type: ignore[arg-type]
            reservation_end="2027-01-01T00:00:00Z",  # type: ignore[arg-type]
        )
    with pytest.raises(PydanticValidationError, match="only reserved"):
        ClusterCreate(
            name="c",
            cluster_type="slurm",  # type: ignore[arg-type]
            num_gpus=8,
            reservation_end="2027-01-01T00:00:00Z",  # type: ignore[arg-type]
        )


def test_cluster_update_rules() -> None:
    assert ClusterUpdate().num_gpus is None
    with pytest.raises(PydanticValidationError, match="multiple of 8"):
        ClusterUpdate(num_gpus=9)
    with pytest.raises(PydanticValidationError, match="at least 8"):
        ClusterUpdate(num_gpus=0)
