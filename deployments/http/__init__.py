"""The OpenAI-compatible HTTP layer: ``make_app(backend)`` returns the FastAPI app.

One job per module: `schemas` (request bodies derived from SamplingParams, response types
from the openai package), `translate` (request -> GenerateRequest, field names in errors),
`responses`, `streaming` (server-sent events), `errors` (OpenAI error bodies), `middleware`
(API key, body size) and `app` (the routes and `make_app`). No Ray here.
"""

from deployments.http.app import Backend, make_app

__all__ = ["Backend", "make_app"]
