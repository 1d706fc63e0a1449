"""One module per wire protocol: its field table, its parsing into a neutral call (base.ChatCall), and its
Encoder (the stream and, folded, the final answer).

    openai.py              the OpenAI field policy, shared by chat and completions
    openai_chat.py         POST /v1/chat/completions
    openai_completions.py  POST /v1/completions
    anthropic.py           POST /v1/messages, /v1/messages/count_tokens (context_edits.py: tool-result clearing)
    responses.py           POST /v1/responses
"""
