"""Image parts of API requests (Qwen2.5-VL, Qwen3-VL), read for the engine.

The three APIs spell an image differently; each request model turns its own spelling into
one `ImageRef` (where the image is, and the request field that named it):

    OpenAI chat   {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
    Responses     {"type": "input_image", "image_url": "data:image/png;base64,..."}
    Messages      {"type": "image", "source": {"type": "base64", "media_type", "data"}}
                  {"type": "image", "source": {"type": "url", "url": "https://..."}}

and puts it in the conversation as the engine's image part, `{"type": "image", "image":
ref}`. `ImageReader.read_images` then replaces every ref by its decoded image (a data URL
or base64 decoded; an http(s) URL fetched only from a host `--allowed-media-domains`
names, with a timeout and a size cap), opened with the pipeline's checks (a header over the
pixel limit is refused before any pixel is decoded). Every refusal is a 400 naming the
part's field, e.g. `messages.0.content.1.image_url`, so a bad image never reaches the
engine and never holds a KV block.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from PIL import Image
from starlette.concurrency import run_in_threadpool

from qinfer.core.errors import RequestError
from qinfer.server.errors import APIError
from qinfer.vision.image import open_image

#: The most bytes one image may have, encoded (a data URL's decoded payload, or a fetch).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: Seconds a fetch of an allowed URL may take, connecting and reading together.
FETCH_TIMEOUT = 10.0


@dataclass(frozen=True)
class ImageRef:
    """An image part not yet read: a URL (data: or http(s):) or base64 `data`, and the
    request field that holds it (what errors name)."""

    field: str
    url: str | None = None
    data: str | None = None


def image_part(ref: ImageRef) -> dict[str, Any]:
    """The engine's content part for an image (`qinfer.text.prompts`), the ref in it
    until `ImageReader.read_images` puts the image there."""
    return {"type": "image", "image": ref}


def refs_in(messages: Sequence[Mapping[str, Any]]) -> list[ImageRef]:
    """Every ImageRef of a conversation, in order."""
    return [
        part["image"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, Mapping) and isinstance(part.get("image"), ImageRef)
    ]


def media_domain(text: str) -> str:
    """One host of `--allowed-media-domains`, lowercased; a URL, a port or a path is a
    ValueError, as it would never equal a URL's host name."""
    host = text.strip().lower().rstrip(".")
    if not host or any(c in host for c in "/:@ ?#"):
        raise ValueError(f"takes host names such as images.example.com, got {text!r}")
    return host


def _refused(ref: ImageRef, reason: str) -> APIError:
    return APIError(
        400, f"Invalid value for '{ref.field}': {reason}", param=ref.field, code="invalid_value"
    )


def accepted_refs(messages: list[dict[str, Any]], accepts_images: bool) -> list[ImageRef]:
    """The conversation's image parts; a 400 naming the first when the model takes none."""
    refs = refs_in(messages)
    if refs and not accepts_images:
        raise _refused(
            refs[0],
            "this model takes no images (it is not a vision-language model, or a GGUF one "
            "served without its projector: --mmproj FILE)",
        )
    return refs


class ImageReader:
    """Reads a request's image refs: decodes inline images, fetches allowed URLs.

    allowed_domains: the hosts whose http(s) URLs are fetched (exact names; none: every
    URL is refused, the default: a server should not fetch what clients point it at)."""

    def __init__(
        self,
        allowed_domains: Sequence[str] = (),
        max_bytes: int = MAX_IMAGE_BYTES,
        timeout: float = FETCH_TIMEOUT,
    ):
        self.allowed_domains = frozenset(host.lower() for host in allowed_domains)
        self.max_bytes, self.timeout = max_bytes, timeout

    async def read_images(
        self, messages: list[dict[str, Any]], accepts_images: bool
    ) -> list[dict[str, Any]]:
        """The conversation with each ImageRef replaced by its decoded image (a 400 naming
        the part when it cannot be read, or when the model takes no images)."""
        refs = accepted_refs(messages, accepts_images)
        if not refs:
            return messages
        images = {ref: await self.read(ref) for ref in refs}

        def replaced(part: Any) -> Any:
            if isinstance(part, Mapping) and isinstance(part.get("image"), ImageRef):
                return {**part, "image": images[part["image"]]}
            return part

        return [
            {**m, "content": [replaced(p) for p in m["content"]]}
            if isinstance(m.get("content"), list)
            else m
            for m in messages
        ]

    async def read(self, ref: ImageRef) -> Image.Image:
        """One image, decoded and checked (`open_image`), or a 400 naming `ref.field`."""
        encoded = await self._bytes(ref)
        try:
            # Decoding takes milliseconds to seconds: off the event loop.
            return await run_in_threadpool(open_image, encoded, ref.field)
        except RequestError as error:
            # The pipeline's words name the image by its field, which the 400 names first.
            reason = str(error).replace(f"image {ref.field} ", "the image ", 1)
            raise _refused(ref, reason) from None

    async def _bytes(self, ref: ImageRef) -> bytes:
        if ref.data is not None:
            return self._decoded(ref, ref.data)
        url = ref.url or ""
        if url.startswith("data:"):
            header, comma, payload = url[len("data:") :].partition(",")
            if not comma or not header.endswith(";base64"):
                raise _refused(ref, "a data URL must be 'data:image/...;base64,<data>'")
            if not header.startswith("image/"):
                raise _refused(
                    ref, f"the data URL holds {header[:-7] or 'no media type'!r}, not an image"
                )
            return self._decoded(ref, payload)
        return await self._fetched(ref, url)

    def _decoded(self, ref: ImageRef, data: str) -> bytes:
        # 4 base64 characters make 3 bytes: refuse a payload over the cap before decoding.
        if len(data) > self.max_bytes * 4 // 3 + 4:
            raise _refused(ref, f"the image is over {self.max_bytes:,} bytes")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise _refused(ref, "the image data is not valid base64") from None

    async def _fetched(self, ref: ImageRef, url: str) -> bytes:
        """The bytes at an allowed http(s) URL (no redirects: one could leave the list)."""
        try:
            parts = urlsplit(url)
            hostname = parts.hostname  # parsed lazily: a bad port or IPv6 host raises here
        except ValueError:
            raise _refused(ref, "the image URL is not a valid URL") from None
        if parts.scheme not in ("http", "https") or not hostname:
            raise _refused(ref, "an image URL must be a data URL or an http(s) URL")
        if hostname.lower() not in self.allowed_domains:
            raise _refused(
                ref,
                f"image URLs of {hostname} are not fetched (the server's "
                "--allowed-media-domains does not name it): send the image as a data URL",
            )
        try:
            # httpx's timeout bounds each read; wait_for bounds the whole fetch (a slow drip)
            return await asyncio.wait_for(self._download(ref, url), self.timeout)
        except (httpx.HTTPError, httpx.InvalidURL, TimeoutError) as error:
            raise _refused(
                ref, f"the image could not be fetched ({type(error).__name__})"
            ) from None

    async def _download(self, ref: ImageRef, url: str) -> bytes:
        """GET `url` without redirects (one could leave the allowed hosts), up to max_bytes."""
        async with (
            httpx.AsyncClient(timeout=self.timeout, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise _refused(ref, f"fetching the image answered HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > self.max_bytes:
                    raise _refused(ref, f"the image is over {self.max_bytes:,} bytes")
            return bytes(body)
