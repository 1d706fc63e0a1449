"""The HTTP API (Starlette) over the orchestrator runtime. From the top down (each imports only what is below it;
tests/test_server_imports.py checks it):

    app.py          the route table, the key guard, errors in the route's flavour; the non-generating routes
    docs.py         /openapi.json and docs/api.md's field tables, from the protocols' FIELDS
    driver.py       the request plumbing: body, prompt, job, events -> a protocol's Encoder (stream or final)
    protocols/      one module per wire protocol: field table, parsing into a ChatCall, Encoder
    conversation.py the neutral OpenAI-style conversation every chat protocol converts to
    validate.py     the shared checks, each naming the caller's field; generation options; size limits
    fields.py       the field policy's rules (honoured, hint, default-only, refused)
    errors.py, logprobs.py, metrics.py
"""
