"""The HTTP edge of media routes: request bodies, model choice, reference images, waiting.

Media routes take JSON or ``multipart/form-data`` (what the official client sends for
``videos.create``, with an optional ``input_reference`` file). Form keys in bracket form
(``nvext[num_frames]``, ``nvext[annotations][]``) become nested objects, so both
encodings validate against the same schema.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from penstock.errors import HttpStatusError, InvalidRequestError, UnsupportedMediaTypeError
from penstock.gateway import Gateway, ServedModel
from penstock.multimodal.encoding import data_url_bytes, image_data_url
from penstock.multimodal.inputs import MediaInputs, MediaRef
from penstock.schemas.json_body import read_json_body

ModelT = TypeVar("ModelT", bound=BaseModel)

_BRACKETS = re.compile(r"\[([^\]]*)\]")


def _form_path(key: str) -> list[str]:
    head, _, rest = key.partition("[")
    return [head, *_BRACKETS.findall("[" + rest)] if rest else [head]


def _place(body: dict[str, Any], path: list[str], value: Any) -> None:
    node = body
    for index, part in enumerate(path[:-1]):
        if path[index + 1] == "":
            node = node.setdefault(part, [])
            break
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise InvalidRequestError(f"form field '{part}' is given twice", param=part)
        node = child
    else:
        node[path[-1]] = value
        return
    if not isinstance(node, list):
        raise InvalidRequestError(f"form field '{path[0]}' mixes list and value", param=path[0])
    node.append(value)


async def read_media_body(request: Request, *, file_fields: frozenset[str]) -> dict[str, Any]:
    """The request body as a dict; uploaded files (only ``file_fields``) as bytes. A body
    that is not a form is read by :func:`~penstock.schemas.json_body.read_json_body`."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        form = await request.form()
        body: dict[str, Any] = {}
        for key, value in form.multi_items():
            path = _form_path(key)
            if isinstance(value, UploadFile):
                if path[0] not in file_fields or len(path) > 1:
                    raise InvalidRequestError(f"{key}: files are not accepted here", param=key)
                value = await value.read()
            _place(body, path, value)
        return body
    body = await read_json_body(request, accepted="application/json or multipart/form-data")
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object")
    return body


def validate_body(schema: type[ModelT], body: dict[str, Any]) -> ModelT:
    """Validate like FastAPI does, so errors read the same (400 naming the field)."""
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc


def fill_default_model(body: dict[str, Any], gateway: Gateway, endpoint_type: str) -> None:
    """Without ``model``, use the only model that serves ``endpoint_type``, if just one."""
    if body.get("model") not in (None, ""):
        return
    candidates = [m for m in gateway.listed_models() if endpoint_type in m.endpoint_types]
    if len(candidates) == 1:
        body["model"] = candidates[0].name
    else:
        body.pop("model", None)


MEDIA_ENDPOINT_TYPES = ("videos", "images")


def generates(served: ServedModel, endpoint_type: str) -> bool:
    """Whether ``served`` answers the media route of ``endpoint_type``: it advertises it,
    and its engine is raw (JSON in, media out)."""
    return endpoint_type in served.endpoint_types and served.host.is_raw


def generates_media(gateway: Gateway) -> bool:
    """Whether any model of ``gateway`` generates videos or images: only such a server
    opens a job store (and imports SQLAlchemy). LoRA adapters added later take their base
    model's endpoint types, so the answer at startup holds for the server's life."""
    return any(
        generates(served, endpoint_type)
        for served in gateway.listed_models()
        for endpoint_type in MEDIA_ENDPOINT_TYPES
    )


def served_for(gateway: Gateway, model: str, endpoint_type: str, route: str) -> ServedModel:
    """The model a media request names, if it generates ``endpoint_type``; a server has a
    media service whenever this returns (:func:`generates_media`)."""
    served = gateway.resolve(model)
    if not generates(served, endpoint_type):
        offered = ", ".join(sorted(served.endpoint_types)) or "nothing"
        raise InvalidRequestError(
            f"The model '{model}' does not serve {route} (it serves: {offered})",
            param="model",
            code="model_not_supported",
        )
    return served


async def reference_data_url(value: Any, media: MediaInputs) -> str:
    """A client's ``input_reference`` as a PNG ``data:`` URL for the engine.

    Accepts an uploaded file, a base64 ``data:`` URL, bare base64, an http(s) or
    ``file://`` URL (fetched by the image loader, under the server's media URL policy and
    limits), or the OpenAI object form ``{"image_url": ...}``. Every form is checked from
    its header against ``--media-max-image-pixels`` (413) and charged to the decoded
    media budget before it is decoded; anything that is not a JPEG, PNG or WEBP image is
    a 415. Decoding and encoding run in a worker thread.
    """
    if isinstance(value, dict):
        if value.get("file_id"):
            raise InvalidRequestError(
                "input_reference.file_id: file references are not supported; upload the "
                "image or send it as a data: URL",
                param="input_reference",
            )
        value = value.get("image_url")
    if isinstance(value, str):
        if value[:8].lower().startswith(("http://", "https://", "file://")):
            (image,) = await media.load_images([MediaRef(value, "input_reference")])
            return await asyncio.to_thread(image_data_url, image)
        data = data_url_bytes(value)
        if data is None:
            raise UnsupportedMediaTypeError(
                "input_reference: not an image (expected an upload, a base64 data: URL or base64)",
                param="input_reference",
            )
    elif isinstance(value, bytes):
        data = value
    else:
        raise InvalidRequestError(
            "input_reference: expected an image upload or a data: URL", param="input_reference"
        )
    try:
        image = await media.decode_image(data, "input_reference")
    except HttpStatusError as exc:
        if exc.status not in (400, 415):
            raise
        reason = "not a JPEG, PNG or WEBP image" if exc.status == 415 else "truncated image data"
        raise UnsupportedMediaTypeError(
            f"input_reference: {reason}", param="input_reference"
        ) from exc
    return await asyncio.to_thread(image_data_url, image)
