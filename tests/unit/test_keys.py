"""Lock keys: equal for equal work, distinct otherwise, and clear about bad arguments."""

from __future__ import annotations

import json
import uuid
from datetime import date, datetime, time, timezone
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads
from redis.crc import key_slot

from celery_redlock import ConfigurationError, LockKeyError, fence_key_for
from celery_redlock.core.keys import KEY_VERSION, KeyBuilder, canonical_json


def report(account, day, fmt="pdf", *, notify=False):
    return account, day, fmt, notify


def builder(spec=None, run=report):
    return KeyBuilder("reports.build", run, spec, "redlock")


def test_positional_keyword_and_default_spellings_share_a_key():
    """Binding to the signature makes every spelling of one call one key."""
    keys = builder()
    expected = keys.key_for((1, "2024-01-01"), {})
    assert keys.key_for((), {"account": 1, "day": "2024-01-01"}) == expected
    assert keys.key_for((1,), {"day": "2024-01-01", "fmt": "pdf"}) == expected
    assert keys.key_for((1, "2024-01-01", "pdf"), {"notify": False}) == expected


def test_different_arguments_or_tasks_get_different_keys():
    """Any difference in the work gives a different key."""
    keys = builder()
    base = keys.key_for((1, "d"), {})
    assert keys.key_for((2, "d"), {}) != base
    assert keys.key_for((1, "d"), {"notify": True}) != base
    assert KeyBuilder("reports.other", report, None, "redlock").key_for((1, "d"), {}) != base


def test_key_format_is_versioned_prefixed_and_hash_tagged():
    """Keys carry prefix, version and a hash tag; on Cluster the fence counter shares its slot."""
    key = builder().key_for((1, "d"), {})
    assert key.startswith(f"redlock:{KEY_VERSION}:{{reports.build:")
    assert key.endswith("}")
    assert key_slot(key.encode()) == key_slot(fence_key_for(key, cluster=True).encode())


def test_tuples_equal_lists_and_dict_order_does_not_matter():
    """Serialisation turns tuples into lists and may reorder dicts: keys must not care."""
    keys = builder()
    a = keys.key_for(((1, 2), {"b": 1, "a": 2}), {})
    b = keys.key_for(([1, 2], {"a": 2, "b": 1}), {})
    assert a == b


VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.datetimes()
    | st.dates()
    | st.times()
    | st.uuids()
    | st.decimals(allow_nan=False, allow_infinity=False)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5) | st.integers(), children, max_size=3)
    ),
    max_leaves=10,
)


@given(VALUES)
def test_key_survives_a_kombu_json_round_trip(value):
    """The worker sees decoded arguments; their key equals the caller's key."""
    keys = builder()
    decoded = kombu_loads(kombu_dumps([value, "d"]))
    assert keys.key_for(tuple(decoded), {}) == keys.key_for((value, "d"), {})


@given(VALUES)
def test_canonical_text_is_what_json_dumps_writes(value):
    """The encoder built once per process writes exactly json.dumps's canonical text."""
    try:
        text = canonical_json({"v": value})
    except TypeError:
        return  # no canonical form: nothing to compare
    plain = json.loads(text)
    assert text == json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def test_tagged_types_match_kombus_wire_form():
    """Dates, times, UUIDs, Decimals and bytes canonicalise as kombu encodes them."""
    values = [
        datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
        date(2024, 1, 2),
        time(3, 4, 5),
        uuid.UUID(int=7),
        Decimal("1.50"),
        b"raw",
        b"\xff\x00",
    ]
    for value in values:
        assert json.loads(canonical_json(value)) == json.loads(kombu_dumps(value))


def test_argument_names_pick_the_identifying_arguments():
    """lock_key=[names] ignores the other arguments."""
    keys = builder(["account"])
    assert keys.key_for((1, "monday"), {}) == keys.key_for((1, "tuesday"), {"fmt": "csv"})
    assert keys.key_for((1, "monday"), {}) != keys.key_for((2, "monday"), {})


def test_unknown_argument_names_fail_at_configuration():
    """Naming an argument the task does not take fails before any call."""
    with pytest.raises(ConfigurationError, match="nope"):
        builder(["account", "nope"])


def test_callable_spec_decides_the_identity():
    """A callable lock_key receives (args, kwargs) and its string is hashed."""
    keys = builder(lambda args, kwargs: f"account-{args[0]}")
    assert keys.identity((1, "d"), {}) == "account-1"
    assert keys.key_for((1, "d"), {}) == keys.key_for((1, "e"), {})


def test_callable_spec_must_return_a_string():
    """A callable returning a non-string is reported, naming the task."""
    keys = builder(lambda args, kwargs: 42)
    with pytest.raises(LockKeyError, match=r"reports\.build"):
        keys.key_for((1, "d"), {})


def test_uncanonicalisable_argument_is_named():
    """An argument with no canonical form fails naming the task and the argument."""
    with pytest.raises(LockKeyError) as info:
        builder().key_for((object(), "d"), {})
    assert info.value.task_name == "reports.build"
    assert info.value.argument == "account"
    assert "lock_key" in str(info.value)


def test_arguments_not_fitting_the_signature_are_reported():
    """A call the task cannot accept fails with the task's name, not a bare TypeError."""
    with pytest.raises(LockKeyError, match="do not fit"):
        builder().key_for((1, 2, 3, 4, 5), {})


def test_var_args_and_var_kwargs_are_part_of_the_key():
    """Tasks taking *args/**kwargs still key on every argument."""

    def loose(*args, **kwargs):
        return args, kwargs

    keys = builder(run=loose)
    assert keys.key_for((1,), {"a": 1}) != keys.key_for((1,), {"a": 2})
    assert keys.key_for((1,), {"a": 1, "b": 2}) == keys.key_for((1,), {"b": 2, "a": 1})


def test_canonical_text_of_named_and_default_specs_is_pinned():
    """The text hashed for ordinary calls stays as v1 defined it, so their keys never move."""
    assert builder().identity((1, "d"), {}) == (
        '{"account":1,"day":"d","fmt":"pdf","notify":false}'
    )
    assert builder(["account", "fmt"]).identity((1, "d"), {}) == '{"account":1,"fmt":"pdf"}'


def by_kwargs(**kwargs):
    return kwargs


def test_names_that_arrive_through_var_kwargs_pick_the_key():
    """lock_key=[name] finds a value that only **kwargs collects, so accounts stay apart."""
    keys = builder(["account_id"], run=by_kwargs)
    one = keys.key_for((), {"account_id": 1})
    assert keys.key_for((), {"account_id": 2}) != one
    assert keys.key_for((), {"account_id": 1, "verbose": True}) == one
    assert keys.identity((), {"account_id": 1}) == '{"account_id":1}'


def test_a_var_kwargs_name_not_passed_keys_as_none():
    """A name **kwargs did not receive has no default: it keys as None, as passing None does."""
    keys = builder(["account_id"], run=by_kwargs)
    assert keys.identity((), {}) == '{"account_id":null}'
    assert keys.key_for((), {}) == keys.key_for((), {"account_id": None})
    assert keys.key_for((), {}) != keys.key_for((), {"account_id": 0})


def test_parameters_come_before_var_kwargs_and_keep_their_spellings():
    """A named parameter is found by position or keyword, and **kwargs cannot shadow it."""

    def sync(account_id, /, region="eu", **kwargs):
        return account_id, region, kwargs

    keys = builder(["account_id", "region", "dry_run"], run=sync)
    expected = keys.key_for((1,), {"dry_run": True})
    assert keys.key_for((1, "eu"), {"dry_run": True}) == expected
    assert keys.key_for((1,), {"region": "eu", "dry_run": True, "other": 3}) == expected
    assert keys.key_for((1,), {"region": "us", "dry_run": True}) != expected
    assert keys.key_for((1,), {"dry_run": False}) != expected
    # The positional-only parameter is what the body sees as account_id.
    assert keys.key_for((1,), {"account_id": 2, "dry_run": True}) == expected
    # The ** parameter itself still names the whole dict, as before.
    whole = builder(["kwargs"], run=by_kwargs)
    assert whole.identity((), {"a": 1}) == '{"kwargs":{"a":1}}'


class Unreadable:
    """A callable whose signature inspect cannot read, like some C callables."""

    __signature__ = "not a signature"

    def __call__(self, *args, **kwargs):
        return args, kwargs


def test_names_are_found_in_the_keyword_arguments_of_a_task_without_signature():
    """With no signature the task counts as (*args, **kwargs): names come from its kwargs."""
    keys = builder(["account_id"], run=Unreadable())
    assert keys.signature is None
    assert keys.key_for((), {"account_id": 1}) != keys.key_for((), {"account_id": 2})
    assert keys.key_for((9,), {"account_id": 1}) == keys.key_for((), {"account_id": 1})
    assert keys.identity((), {}) == '{"account_id":null}'
    assert builder(["args"], run=Unreadable()).identity((1, 2), {}) == '{"args":[1,2]}'
