"""LoRA adapters on the real vLLM 0.32 CPU server: load, generate with the adapter, unload, list (docs/conformance.md#lora-on-the-cpu-build).

The adapters are written by ``scripts/make_tiny_lora.py`` into a private directory (the only prefix the server
allows for local adapters); nothing is downloaded. One ``vllm serve --enable-lora --max-loras 2`` for the
module, started with the field-order fix on its ``PYTHONPATH`` (``tests/real_vllm/lora_field_order``): the
CPU build's engine cannot decode the LoRA request its own Rust frontend sends, which
``test_the_engine_cannot_decode_the_frontends_lora_request`` pins. Every Control and generate call goes
through the project's connection pool, so a refusal arrives as the sidecar's error (``status_to_error``)
with the server's status and text. The last test restarts the server.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import trio
from real_vllm_helpers import GENERATE_STREAM, generate_request, unique_id
from real_vllm_lora import FIELD_ORDER_FIX, MAX_LORAS, launch_lora_server, make_tiny_lora
from real_vllm_server import SERVED_MODEL_NAME, TIMINGS, RealVllmServer, check_env, env_from_environ

from trio_sidecar import GenerateContext, open_sidecar
from trio_sidecar._proto.vllm import control_pb2, inference_pb2
from trio_sidecar.core.config import SidecarConfig
from trio_sidecar.core.endpoint import parse_grpc_endpoint
from trio_sidecar.core.errors import InvalidArgument, SidecarError
from trio_sidecar.core.lora_requests import LoadResult, LoraAdapter
from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock import MockConfig, open_mock_server
from trio_sidecar.shell.pool import open_channel_pool

MAX_LORA_RANK = 16  # vLLM's default --max-lora-rank
CALL_TIMEOUT_S = 120.0
# The engine's add_lora failures arrive wrapped by the Rust frontend; call_id counts the utility calls.
ENGINE_FAILURE = (
    r"failed to load LoRA adapter `{name}`: utility call `add_lora` failed \(call_id=\d+\): "
    r"Call to add_lora method failed: Worker failed with error '{error}', "
    r"please check the stack trace above for the root cause"
)


class LoraServer:
    """The module's server, its adapter directory and the adapters written there (name -> path)."""

    def __init__(self) -> None:
        env = env_from_environ()
        assert env is not None
        check_env(env)
        self.env = env
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="real-vllm-lora-"))
        self.adapters = {
            "seed1": make_tiny_lora(self.adapter_dir / "seed1", seed=1),
            "seed2": make_tiny_lora(self.adapter_dir / "seed2", seed=2),
            "seed3": make_tiny_lora(self.adapter_dir / "seed3", seed=3),
            "rank32": make_tiny_lora(self.adapter_dir / "rank32", rank=2 * MAX_LORA_RANK),
        }
        (self.adapter_dir / "not-an-adapter").mkdir()
        self.server: RealVllmServer | None = None

    def start(self, *extra_args: str) -> RealVllmServer:
        self.server = launch_lora_server(self.env, self.adapter_dir, *extra_args)
        try:
            self.server.wait_ready()
        except BaseException:
            self.stop()
            raise
        TIMINGS.append(("python launch (LoRA, field-order fix): start -> SERVING", self.server.ready_after_s or 0.0))
        return self.server

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is None:
            return
        try:
            server.stop()
            assert not server.leftovers(), f"vLLM processes still running after stop: {server.leftovers()}"
        finally:
            server.cleanup_files()


@pytest.fixture(scope="module")
def lora_server():
    owner = LoraServer()
    try:
        owner.start()
        yield owner
    finally:
        try:
            owner.stop()
        finally:
            shutil.rmtree(owner.adapter_dir, ignore_errors=True)


@pytest.fixture
async def pool(lora_server):
    server = lora_server.server
    assert server is not None, "the LoRA server is not running"
    config = SidecarConfig(grpc_endpoint=server.endpoint, grpc_connections=1)
    with trio.fail_after(60):
        async with open_channel_pool(
            parse_grpc_endpoint(config.grpc_endpoint), config, deadline=trio.current_time() + 30
        ) as opened:
            yield opened


async def control(pool, rpc: str, **fields):
    """("OK", response) or (code, text) of one Control call through the pool."""
    request = getattr(control_pb2, f"{rpc}Request")(**fields)
    try:
        with trio.fail_after(CALL_TIMEOUT_S + 10):
            response = await pool.unary(
                rpc, f"/vllm.Control/{rpc}", request, getattr(control_pb2, f"{rpc}Response"), timeout=CALL_TIMEOUT_S
            )
    except SidecarError as e:
        return e.grpc_code, e.grpc_message
    return "OK", response


async def generate(pool, lora_name: str = "", max_new_tokens: int = 8):
    """The greedy tokens of one GenerateStream through the pool, or (code, text) when it is refused."""
    request = generate_request(unique_id("lora"), max_new_tokens=max_new_tokens, lora_name=lora_name)
    tokens: list[int] = []
    try:
        with trio.fail_after(CALL_TIMEOUT_S + 10):
            async with pool.stream(
                "GenerateStream", GENERATE_STREAM, request, inference_pb2.GenerateResponse, timeout=CALL_TIMEOUT_S
            ) as responses:
                async for message in responses:
                    tokens.extend(message.outputs.token_ids)
    except SidecarError as e:
        return e.grpc_code, e.grpc_message
    assert len(tokens) == max_new_tokens, tokens
    return tokens


def adapter(lora_id: int, name: str, path: Path) -> control_pb2.LoraAdapter:
    return control_pb2.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=str(path))


async def listed(pool) -> dict[str, control_pb2.LoraAdapter]:
    """``ListLoras`` by name (vLLM lists its adapter table in hash order, not load order)."""
    outcome, response = await control(pool, "ListLoras")
    assert outcome == "OK", response
    return {a.lora_name: a for a in response.adapters}


async def test_an_adapter_is_loaded_changes_the_output_and_is_unloaded(pool, lora_server):
    path = lora_server.adapters["seed1"]
    name = unique_id("life")
    base = await generate(pool)
    assert name not in await listed(pool)

    outcome, loaded = await control(pool, "LoadLora", lora_name=name, source_path=str(path))
    assert outcome == "OK", loaded
    assert (loaded.adapter.lora_name, loaded.adapter.source_path) == (name, str(path))
    assert loaded.adapter.lora_id >= 1
    assert (await listed(pool))[name] == loaded.adapter

    with_adapter = await generate(pool, name)
    assert with_adapter != base, "greedy output with the adapter equals the base model's: adapter not applied"
    assert await generate(pool, name) == with_adapter  # greedy: the same adapter gives the same tokens
    assert await generate(pool) == base  # the base model is unchanged while the adapter is loaded

    assert await control(pool, "UnloadLora", lora_name=name) == (
        "OK",
        control_pb2.UnloadLoraResponse(adapter=loaded.adapter),
    )
    assert name not in await listed(pool)
    assert await generate(pool, name) == (StatusCode.NOT_FOUND, f"LoRA adapter `{name}` is not loaded")
    assert await generate(pool) == base


async def test_more_adapters_than_max_loras_load_serve_and_unload_once_used(pool, lora_server):
    """``--max-loras`` bounds the adapters of one batch, not the loaded ones. The engine's adapter cache (as
    large as ``max_loras``) evicts the least recently used adapter: it stays listed and serves requests, but
    ``UnloadLora`` fails until a request has brought it back (docs/conformance.md#lora-on-the-cpu-build)."""
    paths = lora_server.adapters
    names = {key: unique_id(key) for key in ("seed1", "seed2", "seed3")}
    copy = unique_id("seed1-copy")
    loaded = {}
    for name, key in [*((n, k) for k, n in names.items()), (copy, "seed1")]:
        outcome, response = await control(pool, "LoadLora", lora_name=name, source_path=str(paths[key]))
        assert outcome == "OK", response
        loaded[name] = response.adapter
    assert len(loaded) == MAX_LORAS + 2
    ids = [a.lora_id for a in loaded.values()]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids  # every load takes the next id
    assert {n: a for n, a in (await listed(pool)).items() if n in loaded} == loaded

    # Cache now: seed3, copy. seed1 and seed2 were evicted, and cannot be unloaded.
    for key in ("seed1", "seed2"):
        name = names[key]
        assert await control(pool, "UnloadLora", lora_name=name) == (
            StatusCode.INTERNAL,
            f"engine rejected removal of LoRA adapter `{name}` with id {loaded[name].lora_id}",
        )
    assert {n: a for n, a in (await listed(pool)).items() if n in loaded} == loaded

    outputs = {}
    for name in loaded:  # each request brings its adapter back (evicting another), then it can be unloaded
        outputs[name] = await generate(pool, name)
        assert await control(pool, "UnloadLora", lora_name=name) == (
            "OK",
            control_pb2.UnloadLoraResponse(adapter=loaded[name]),
        )
    assert not set(loaded) & set(await listed(pool))
    assert outputs[copy] == outputs[names["seed1"]]  # the same weights under another name
    distinct = [outputs[names[key]] for key in ("seed1", "seed2", "seed3")] + [await generate(pool)]
    assert len({tuple(t) for t in distinct}) == 4, distinct


async def test_the_lora_refusals_of_the_real_server(pool, lora_server):
    """Exact texts (docs/conformance.md#lora-on-the-cpu-build); none of these leaves an adapter behind."""
    paths, base = lora_server.adapters, lora_server.adapter_dir
    name = unique_id("dup")
    assert (await control(pool, "LoadLora", lora_name=name, source_path=str(paths["seed2"])))[0] == "OK"
    before = await listed(pool)
    assert await generate(pool, "never-loaded") == (StatusCode.NOT_FOUND, "LoRA adapter `never-loaded` is not loaded")
    assert await control(pool, "UnloadLora", lora_name="never-loaded") == (
        StatusCode.NOT_FOUND,
        "LoRA adapter `never-loaded` is not loaded",
    )
    assert await control(pool, "UnloadLora") == (StatusCode.INVALID_ARGUMENT, "lora_name is required")
    for path in (paths["seed2"], paths["seed3"]):  # the name decides, whatever the path
        assert await control(pool, "LoadLora", lora_name=name, source_path=str(path)) == (
            StatusCode.ALREADY_EXISTS,
            f"LoRA adapter `{name}` is already loaded",
        )
    assert await control(pool, "LoadLora", lora_name=SERVED_MODEL_NAME, source_path=str(paths["seed1"])) == (
        StatusCode.ALREADY_EXISTS,
        f"LoRA adapter `{SERVED_MODEL_NAME}` conflicts with a served base model",
    )
    assert await control(pool, "LoadLora", source_path=str(paths["seed1"])) == (
        StatusCode.INVALID_ARGUMENT,
        "lora_name must not be empty",
    )
    assert await control(pool, "LoadLora", lora_name="p") == (
        StatusCode.INVALID_ARGUMENT,
        "lora_path must not be empty",
    )
    assert await control(pool, "LoadLora", lora_name="p", source_path=str(base / "missing")) == (
        StatusCode.INVALID_ARGUMENT,
        "Local LoRA adapter path must exist and be accessible.",
    )
    assert await control(pool, "LoadLora", lora_name="p", source_path="/") == (
        StatusCode.INVALID_ARGUMENT,
        "Local LoRA adapter path is outside the configured allowed prefixes.",
    )
    # The engine's own checks: the Rust frontend wraps them in INTERNAL.
    code, text = await control(pool, "LoadLora", lora_name="empty-dir", source_path=str(base / "not-an-adapter"))
    assert code == StatusCode.INTERNAL, text
    error = re.escape(f"Loading lora empty-dir failed: No adapter found for {base / 'not-an-adapter'}")
    assert re.fullmatch(ENGINE_FAILURE.format(name="empty-dir", error=error), text), text
    code, text = await control(pool, "LoadLora", lora_name="rank32", source_path=str(paths["rank32"]))
    assert code == StatusCode.INTERNAL, text
    error = re.escape(f"LoRA rank {2 * MAX_LORA_RANK} is greater than max_lora_rank {MAX_LORA_RANK}.")
    assert re.fullmatch(ENGINE_FAILURE.format(name="rank32", error=error), text), text
    assert await listed(pool) == before
    assert (await control(pool, "UnloadLora", lora_name=name))[0] == "OK"


SESSION_NAMES = ("a", "b", "c")


async def run_session(pool, seed1: Path, seed2: Path) -> list:
    """One LoRA session as a client sees it: every outcome, ids made relative to the session's first load
    (so "with id N" texts too), a generate as True when it produced its tokens."""
    first = None

    def relative(outcome):
        if isinstance(outcome, list):
            return True
        if outcome[0] != "OK":
            code, text = outcome
            match = re.fullmatch(r"(engine rejected removal of LoRA adapter `\w+` with id )(\d+)", text)
            return (code, f"{match[1]}+{int(match[2]) - first}") if match else outcome
        response = outcome[1]
        adapters = list(response.adapters) if hasattr(response, "adapters") else [response.adapter]
        return (
            "OK",
            sorted((a.lora_id - first, a.lora_name, a.source_path) for a in adapters if a.lora_name in SESSION_NAMES),
        )

    load_a = await control(pool, "LoadLora", lora_name="a", source_path=str(seed1))
    assert load_a[0] == "OK", load_a
    first = load_a[1].adapter.lora_id
    out = [relative(load_a)]
    for rpc, fields in (
        ("LoadLora", {"lora_name": "b", "source_path": str(seed2)}),
        ("LoadLora", {"lora_name": "a", "source_path": str(seed2)}),
        ("LoadLora", {"lora_name": SERVED_MODEL_NAME, "source_path": str(seed1)}),
        ("LoadLora", {"lora_name": "c", "source_path": str(seed1)}),  # a third one: evicts a from the cache
        ("ListLoras", {}),
        ("UnloadLora", {"lora_name": "zz"}),
        ("UnloadLora", {"lora_name": "a"}),  # evicted
        ("ListLoras", {}),
        ("generate", {"lora_name": "a"}),  # brings a back, evicts b
        ("UnloadLora", {"lora_name": "a"}),
        ("UnloadLora", {"lora_name": "b"}),  # evicted
        ("generate", {"lora_name": "b"}),
        ("UnloadLora", {"lora_name": "b"}),
        ("UnloadLora", {"lora_name": "c"}),
        ("generate", {"lora_name": "c"}),
        ("LoadLora", {"lora_name": "a", "source_path": str(seed1)}),  # a new id, never reused
        ("ListLoras", {}),
        ("UnloadLora", {"lora_name": "a"}),
    ):
        if rpc == "generate":
            out.append(relative(await generate(pool, **fields)))
        else:
            out.append(relative(await control(pool, rpc, **fields)))
    return out


async def test_a_lora_session_answers_as_on_the_mock(pool, lora_server):
    """The same session on the real server and on the mock (docs/reference/mock.md#lora-adapters): codes, texts,
    adapters and their ids, the engine cache's evictions. Generate is compared by outcome only (the mock's
    tokens ignore adapters)."""
    seed1, seed2 = lora_server.adapters["seed1"], lora_server.adapters["seed2"]
    config = MockConfig(listen="127.0.0.1:0", served_model_name=SERVED_MODEL_NAME, engine_args={"max_loras": MAX_LORAS})
    answers = {}
    async with open_mock_server(config) as mock:
        mock_config = SidecarConfig(grpc_endpoint=f"127.0.0.1:{mock.port}", grpc_connections=1)
        async with open_channel_pool(
            parse_grpc_endpoint(mock_config.grpc_endpoint), mock_config, deadline=trio.current_time() + 30
        ) as mock_pool:
            for side, channel_pool in (("real", pool), ("mock", mock_pool)):
                assert not set(SESSION_NAMES) & set(await listed(channel_pool)), side
                answers[side] = await run_session(channel_pool, seed1, seed2)
    a, b, c = ((0, "a", str(seed1)), (1, "b", str(seed2)), (2, "c", str(seed1)))
    assert answers["real"] == [
        ("OK", [a]),
        ("OK", [b]),
        (StatusCode.ALREADY_EXISTS, "LoRA adapter `a` is already loaded"),
        (StatusCode.ALREADY_EXISTS, f"LoRA adapter `{SERVED_MODEL_NAME}` conflicts with a served base model"),
        ("OK", [c]),
        ("OK", [a, b, c]),
        (StatusCode.NOT_FOUND, "LoRA adapter `zz` is not loaded"),
        (StatusCode.INTERNAL, "engine rejected removal of LoRA adapter `a` with id +0"),
        ("OK", [a, b, c]),
        True,
        ("OK", [a]),
        (StatusCode.INTERNAL, "engine rejected removal of LoRA adapter `b` with id +1"),
        True,
        ("OK", [b]),
        ("OK", [c]),
        (StatusCode.NOT_FOUND, "LoRA adapter `c` is not loaded"),
        ("OK", [(3, "a", str(seed1))]),
        ("OK", [(3, "a", str(seed1))]),
        ("OK", [(3, "a", str(seed1))]),
    ]
    assert answers["mock"] == answers["real"]


def test_the_engine_cannot_decode_the_frontends_lora_request():
    """Why ``LoadLora`` fails on vLLM 0.32 (docs/conformance.md#lora-on-the-cpu-build): the Rust frontend sends
    ``LoRARequest`` as seven array elements (with ``tensorizer_config_dict`` at index 4), the engine's struct
    has six. Checked in the provisioned venv, with and without the fix the module's server runs with; when
    vLLM realigns the two, this test fails and the fix (and docs/conformance.md row 8c) can go."""
    env = env_from_environ()
    assert env is not None
    sent = '["a", 1, "/adapter", None, None, False, False]'  # vllm-rs 0.32.0: name, id, path, base, tensorizer, inplace, 3d
    script = (
        "import msgspec\n"
        "from vllm.lora.request import LoRARequest\n"
        f"try:\n    print(repr(msgspec.convert({sent}, type=LoRARequest)))\n"
        "except msgspec.ValidationError as e:\n    print('ValidationError:', e)\n"
    )

    def run(extra_env: dict[str, str]) -> str:
        done = subprocess.run(
            [str(env.python), "-c", script],
            capture_output=True,
            text=True,
            timeout=300,
            env={"PATH": str(env.venv_bin), "HOME": str(Path.home()), "VLLM_TARGET_DEVICE": "cpu", **extra_env},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    assert run({}) == "ValidationError: Expected `bool`, got `null` - at `$[4]`"
    assert run({"PYTHONPATH": str(FIELD_ORDER_FIX)}) == (
        "LoRARequest(lora_name='a', lora_int_id=1, lora_path='/adapter', base_model_name=None, "
        "tensorizer_config_dict=None, load_inplace=False, is_3d_lora_weight=False)"
    )


async def test_the_embedded_api_loads_generates_with_and_unloads_an_adapter(pool, lora_server):
    """``Sidecar.load_lora`` / ``list_loras`` / ``unload_lora`` and ``routing.lora_name`` (docs/lora.md#embedded-api)
    against the real engine: the sidecar's tokens with the adapter are the direct call's, not the base model's."""
    server, path = lora_server.server, lora_server.adapters["seed2"]
    name = unique_id("embedded")
    config = SidecarConfig(grpc_endpoint=server.endpoint, grpc_connections=1, health_prober=False)

    async def sidecar_tokens(sidecar, lora_name: str | None, request_id: str) -> list[int]:
        body: dict = {
            "token_ids": [5, 6, 7, 8],
            "stop_conditions": {"max_tokens": 8, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0},
        }
        if lora_name is not None:
            body["routing"] = {"lora_name": lora_name}
        async with sidecar.generate(body, GenerateContext(request_id)) as stream:
            return [t for chunk in [c async for c in stream] for t in chunk.token_ids]

    with trio.fail_after(60 + 8 * CALL_TIMEOUT_S):
        async with open_sidecar(config) as sidecar:
            base = await sidecar_tokens(sidecar, None, unique_id("base"))
            assert base == await generate(pool)
            loaded = await sidecar.load_lora(name, str(path))
            assert loaded == LoadResult(LoraAdapter(name, loaded.adapter.lora_id, str(path)), already_loaded=False)
            assert loaded.adapter in await sidecar.list_loras()
            assert (await sidecar.load_lora(name, str(path))).already_loaded
            with_adapter = await sidecar_tokens(sidecar, name, unique_id("with"))
            assert with_adapter == await generate(pool, name) != base
            assert await sidecar.unload_lora(name) == loaded.adapter
            assert loaded.adapter not in await sidecar.list_loras()
            with pytest.raises(InvalidArgument) as refused:
                await sidecar_tokens(sidecar, name, unique_id("gone"))
            assert str(refused.value) == f"GenerateStream: LoRA adapter `{name}` is not loaded (NotFound)"


# Last in the module: it replaces the server (a stop and a start: up to 5 minutes on a loaded machine).
@pytest.mark.timeout(600)
async def test_loaded_adapters_do_not_survive_a_server_restart(lora_server):
    """vLLM keeps adapters in memory only: after a restart the adapters loaded before are gone (generate with the
    name is refused) and ids start again from 1 (what a sidecar reconciling adapters has to redo). The new
    server is started with ``--lora-modules``: such an adapter is there from the start, with id 1."""
    path, preloaded = lora_server.adapters["seed3"], lora_server.adapters["seed1"]

    async def session(check):
        server = lora_server.server
        config = SidecarConfig(grpc_endpoint=server.endpoint, grpc_connections=1)
        with trio.fail_after(60 + 4 * CALL_TIMEOUT_S):
            async with open_channel_pool(
                parse_grpc_endpoint(config.grpc_endpoint), config, deadline=trio.current_time() + 30
            ) as channel_pool:
                return await check(channel_pool)

    async def before(channel_pool):
        outcome, response = await control(channel_pool, "LoadLora", lora_name="kept", source_path=str(path))
        assert outcome == "OK", response
        assert "kept" in await listed(channel_pool)
        return await generate(channel_pool, "kept"), await generate(channel_pool, "preloaded")

    async def after(channel_pool):
        listing = await listed(channel_pool)
        refused = await generate(channel_pool, "kept")
        outcome, response = await control(channel_pool, "LoadLora", lora_name="kept", source_path=str(path))
        return (
            listing,
            refused,
            (outcome, response),
            await generate(channel_pool, "kept"),
            await generate(channel_pool, "preloaded"),
        )

    tokens, not_yet = await session(before)
    assert not_yet == (StatusCode.NOT_FOUND, "LoRA adapter `preloaded` is not loaded")
    lora_server.stop()
    await trio.to_thread.run_sync(lora_server.start, "--lora-modules", f"preloaded={preloaded}")
    listing, refused, (outcome, response), tokens_again, preloaded_tokens = await session(after)
    assert listing == {"preloaded": adapter(1, "preloaded", preloaded)}
    assert refused == (StatusCode.NOT_FOUND, "LoRA adapter `kept` is not loaded")
    assert (outcome, response.adapter) == ("OK", adapter(2, "kept", path))
    assert tokens_again == tokens  # the same adapter files give the same output after the restart
    assert preloaded_tokens not in (tokens, await session(lambda channel_pool: generate(channel_pool)))
