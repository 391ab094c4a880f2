"""OpenAI's Responses API: ``/v1/responses``, and the responses a later request may continue."""
