"""OpenAI-compatible HTTP server: `protocol` (wire types), `serving` (engine in, responses out), `app` (routes)."""
