"""HTTP calls to one SGLang server (0.5.x native API), and what their failures mean.

Only SGLang's native endpoints are used: `/generate` (token ids in, streamed chunks with
per-token log-probs out), `/health`, `/model_info`, `/get_server_info`,
`/pause_generation`, `/continue_generation`, `/update_weights_from_disk`,
`/load_lora_adapter`, `/unload_lora_adapter`, `/v1/models` (the adapters loaded) and
`/abort_request`. A failure of the server itself (refused connection, timeout, 5xx, a
stream cut short) is a `ReplicaUnavailable`; a request the server refuses (4xx) is a
`RequestRefused` carrying SGLang's message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

CONNECT_TIMEOUT_S = 5.0
CONTROL_TIMEOUT_S = 30.0


class ReplicaUnavailable(RuntimeError):
    """The server did not answer (down, stuck, or failing); `refused`: nothing listens."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class RequestRefused(ValueError):
    """The server answered 4xx: the request itself is wrong (SGLang's message)."""


def error_message(response: httpx.Response) -> str:
    """SGLang's error text, from any of the error shapes it uses."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500] or f"HTTP {response.status_code}"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if data.get(key):
                return str(data[key]).split("\n\n")[0][:500]
    return str(data)[:500]


class SGLangClient:
    """One SGLang server's HTTP API; `read_timeout_s` bounds the wait between two chunks."""

    def __init__(self, url: str, read_timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def generate(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream `/generate` chunks (`body` with "stream": true); the last one finishes."""
        try:
            async with self._http.stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._raise_for(response, "generate")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    chunk = json.loads(payload)
                    if "error" in chunk and "meta_info" not in chunk:
                        raise RequestRefused(str(chunk["error"]))
                    yield chunk
        except httpx.ConnectError as exc:
            raise ReplicaUnavailable(f"{self.url}: {exc}", refused=True) from None
        except (httpx.TransportError, ValueError) as exc:
            if isinstance(exc, RequestRefused):
                raise
            raise ReplicaUnavailable(f"{self.url}: generation stream failed ({exc})") from None

    def _raise_for(self, response: httpx.Response, what: str) -> None:
        message = error_message(response)
        if 400 <= response.status_code < 500:
            raise RequestRefused(message)
        raise ReplicaUnavailable(f"{self.url}: {what} answered {response.status_code}: {message}")

    async def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        timeout_s: float = CONTROL_TIMEOUT_S,
    ) -> dict[str, Any]:
        """A control call; its JSON answer, or ReplicaUnavailable / RequestRefused."""
        try:
            response = await self._http.request(method, path, json=body, timeout=timeout_s)
        except httpx.ConnectError as exc:
            raise ReplicaUnavailable(f"{self.url}: {exc}", refused=True) from None
        except httpx.TransportError as exc:
            raise ReplicaUnavailable(f"{self.url}{path}: {type(exc).__name__} {exc}") from None
        if response.status_code != 200:
            self._raise_for(response, path)
        try:
            data = response.json()
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {"value": data}

    async def health(self, timeout_s: float) -> None:
        """Raise ReplicaUnavailable unless `/health` answers 200 in time."""
        await self.call("GET", "/health", timeout_s=timeout_s)

    async def model_info(self) -> dict[str, Any]:
        """`/model_info`: model_path, weight_version, ..."""
        return await self.call("GET", "/model_info")

    async def server_info(self) -> dict[str, Any]:
        """`/get_server_info`: the server's arguments and limits."""
        return await self.call("GET", "/get_server_info")

    async def pause(self, mode: str) -> None:
        """`/pause_generation` in the given mode (abort, retract, in_place)."""
        await self.call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """`/continue_generation`."""
        await self.call("POST", "/continue_generation", {})

    async def update_weights(
        self, path: str, version: str, flush_cache: bool, timeout_s: float
    ) -> tuple[bool, str]:
        """`/update_weights_from_disk`; (success, SGLang's message)."""
        body: dict[str, Any] = {"model_path": path, "weight_version": version}
        if not flush_cache:
            body["flush_cache"] = False
        try:
            data = await self.call("POST", "/update_weights_from_disk", body, timeout_s)
        except RequestRefused as exc:
            return False, str(exc)
        return bool(data.get("success")), str(data.get("message", ""))

    async def load_lora(self, name: str, path: str, timeout_s: float) -> tuple[bool, str]:
        """`/load_lora_adapter` under `name`; (success, SGLang's message)."""
        return await self._lora_call(
            "/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout_s
        )

    async def unload_lora(self, name: str, timeout_s: float) -> tuple[bool, str]:
        """`/unload_lora_adapter` (SGLang waits for the requests still using it)."""
        return await self._lora_call("/unload_lora_adapter", {"lora_name": name}, timeout_s)

    async def _lora_call(
        self, path: str, body: dict[str, Any], timeout_s: float
    ) -> tuple[bool, str]:
        """SGLang answers these with `{"success", "error_message"}` (400 when it failed)."""
        try:
            response = await self._http.post(path, json=body, timeout=timeout_s)
        except httpx.ConnectError as exc:
            raise ReplicaUnavailable(f"{self.url}: {exc}", refused=True) from None
        except httpx.TransportError as exc:
            raise ReplicaUnavailable(f"{self.url}{path}: {type(exc).__name__} {exc}") from None
        if response.status_code >= 500:
            self._raise_for(response, path)
        try:
            data = response.json()
        except ValueError:
            return False, response.text[:500] or f"HTTP {response.status_code}"
        if not isinstance(data, dict):
            return False, str(data)[:500]
        ok = bool(data.get("success")) and response.status_code == 200
        message = data.get("error_message") or ("" if ok else error_message(response))
        return ok, str(message)

    async def loaded_loras(self) -> set[str]:
        """The LoRA adapter names the server has loaded (from `/v1/models`)."""
        data = (await self.call("GET", "/v1/models")).get("data") or []
        return {str(m["id"]) for m in data if isinstance(m, dict) and m.get("parent")}

    async def abort(self, rid: str) -> None:
        """`/abort_request` for one request id (best effort)."""
        await self.call("POST", "/abort_request", {"rid": rid}, timeout_s=CONNECT_TIMEOUT_S)
