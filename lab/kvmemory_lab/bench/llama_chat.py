"""llama.cpp as a LangChain chat model for the agent-loop benchmark: the peer an agent would run
instead of ``ChatKVMemory`` on the same GGUF.

It renders the history with the same chat template and tools as ``ChatKVMemory`` (kvmemory's
``render_text``), lets llama-cpp-python keep the longest common token prefix of its previous
call's KV cache (what the llama.cpp server and Ollama do for one slot), decodes greedy, and holds
the answer to the same xgrammar grammar ``ChatKVMemory`` would use for the call (tool calls under
``tool_choice``; ``auto_tool_calls="after_user"``: a call after a user turn), applied to llama.cpp's
logits. The text is parsed into tool calls by kvmemory's parser. So both systems answer the same
prompts under the same constraints; only the engine and its cache differ.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, PrivateAttr

from kvmemory.models import load_model
from kvmemory.prompt import normalize_messages, render_text, template_renders_tools
from kvmemory.session import stop_token_ids
from langchain_kvmemory.constrained import Grammars, processor
from langchain_kvmemory.messages import to_session_messages
from langchain_kvmemory.tool_calls import CALL_OPEN, bare_calls, split_calls


class LlamaCppChat(BaseChatModel):
    """``Llama`` (llama-cpp-python) on ``gguf`` behind LangChain's chat-model interface.

    ``model``: what ``kvmemory.load_model`` loads for the tokenizer and chat template (None: the
    embedded model); ``gguf``: the same model as GGUF; ``threads``: llama.cpp's threads.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    gguf: str
    model: str | None = None
    threads: int = 2
    n_ctx: int = 4096
    max_tokens: int = 48
    auto_tool_calls: str = "model"
    _llm: Any = PrivateAttr(default=None)
    _tokenizer: Any = PrivateAttr(default=None)
    _grammars: Any = PrivateAttr(default=None)
    _stops: set = PrivateAttr(default_factory=set)

    def model_post_init(self, context: Any) -> None:
        import llama_cpp

        loaded = load_model(self.model, "fp32", engine="transformers")
        self._tokenizer = loaded.tokenizer
        self._stops = stop_token_ids(loaded.model, loaded.tokenizer)
        self._grammars = Grammars(loaded.tokenizer, loaded.model.config.vocab_size)
        self._llm = llama_cpp.Llama(model_path=self.gguf, n_ctx=self.n_ctx, n_threads=self.threads,
                                    n_threads_batch=self.threads, verbose=False)

    @property
    def _llm_type(self) -> str:
        return "llama-cpp-bench"

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any):
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], tool_choice=tool_choice, **kwargs)

    def _generate(self, messages: list[BaseMessage], stop=None, run_manager=None, **kwargs: Any) -> ChatResult:
        tools = kwargs.get("tools") or None
        template_tools = template_renders_tools(self._tokenizer)
        text = render_text(self._tokenizer, normalize_messages(to_session_messages(messages, template_tools)),
                           tools=tools)
        prompt = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        grammar = self._grammar(tools, kwargs.get("tool_choice"), messages)
        answer = self._decode(prompt, grammar)
        out = self._llm.detokenize(answer).decode("utf-8", errors="replace")
        content, calls = out.strip(), []
        if tools and CALL_OPEN in out:
            content, calls, _ = split_calls(out)
        elif tools:
            calls = bare_calls(out, {t["function"]["name"] for t in tools})
            content = "" if calls else content
        message = AIMessage(content=content, tool_calls=calls,
                            usage_metadata={"input_tokens": len(prompt), "output_tokens": len(answer),
                                            "total_tokens": len(prompt) + len(answer)})
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _grammar(self, tools, tool_choice, messages):
        """The grammar ``ChatKVMemory`` would hold this call's answer to (None: free text)."""
        if not tools:
            return None
        choice = tool_choice if isinstance(tool_choice, str) and tool_choice not in ("auto", "any") else (
            "required" if tool_choice == "any" else "auto")
        if choice == "auto" and self.auto_tool_calls == "after_user":
            choice = "required" if isinstance(messages[-1], HumanMessage) else "auto"
        return self._grammars.tool_calls(tools, choice, parallel=False)

    def _decode(self, prompt: list[int], grammar) -> list[int]:
        """Greedy tokens after ``prompt`` until an end-of-turn token or ``max_tokens``."""
        logits_processor = None
        if grammar is not None:
            constrain = processor(grammar)

            def logits_processor(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
                ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))[None]
                return constrain(ids, torch.from_numpy(scores.copy())[None])[0].numpy()

        answer: list[int] = []
        import llama_cpp

        chain = llama_cpp.LogitsProcessorList([logits_processor]) if logits_processor else None
        tokens = self._llm.generate(prompt, temp=0.0, repeat_penalty=1.0, logits_processor=chain)
        try:
            for token in tokens:
                if int(token) in self._stops:
                    break
                answer.append(int(token))
                if len(answer) >= self.max_tokens:
                    break
        finally:
            tokens.close()
        return answer
