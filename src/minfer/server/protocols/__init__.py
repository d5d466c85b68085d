"""The request bodies of each API family the server speaks, one module per family: each checks its
bodies field by field into plain request objects (a bad field is an
:class:`~minfer.server.errors.ApiError` naming it) and, where the family's answers are not chat
completions, formats the chat turn's events back into its own answers.

- :mod:`.openai`: chat completions and completions (and what every family shares: the sampling and
  output fields, :class:`~.openai.ChatRequest`, :func:`~.openai.parse_chat`).
- :mod:`.embeddings`: ``/v1/embeddings`` and llama-server's ``/embedding``.
- :mod:`.llama`: llama-server's native ``/completion`` and ``/infill``.
- :mod:`.responses`: OpenAI Responses, translated to a chat request and back.
- :mod:`.anthropic`: Anthropic Messages, translated to a chat request and back.
"""
