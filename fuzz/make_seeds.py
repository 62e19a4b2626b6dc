#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora (fuzz/corpus/<harness>/): small valid
inputs of each format, from which libFuzzer mutates. Run once; the output is
checked in. Standard library only."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(harness, name, data):
    d = os.path.join(HERE, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- GGUF (v3, little endian) ---
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload):
    return gstr(key) + struct.pack("<I", vtype) + payload


U32, F32, STRING, ARRAY = 4, 6, 8, 9


def gguf(keys, tensors):
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(keys)) + b"".join(keys)
    infos, data = b"", b""
    for name, dims, values in tensors:
        infos += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", 0, len(data))  # F32, offset
        blob = struct.pack("<%df" % len(values), *values)
        data += blob + b"\0" * ((-len(blob)) % 32)
    out = head + infos
    out += b"\0" * ((-len(out)) % 32)
    return out + data


tokens = ["<unk>", "<s>", "</s>", "\u2581a", "\u2581b", "a", "b", "<0x41>"]
vocab = [
    kv("tokenizer.ggml.model", STRING, gstr("llama")),
    kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, len(tokens)) + b"".join(gstr(t) for t in tokens)),
    kv("tokenizer.ggml.scores", ARRAY, struct.pack("<IQ", F32, len(tokens)) + struct.pack("<%df" % len(tokens), *range(len(tokens)))),
]
arch = [
    kv("general.architecture", STRING, gstr("llama")),
    kv("llama.block_count", U32, struct.pack("<I", 1)),
    kv("llama.embedding_length", U32, struct.pack("<I", 4)),
    kv("llama.feed_forward_length", U32, struct.pack("<I", 8)),
    kv("llama.context_length", U32, struct.pack("<I", 16)),
    kv("llama.attention.head_count", U32, struct.pack("<I", 2)),
]
z = lambda n: [0.01 * i for i in range(n)]
tensors = [("token_embd.weight", [4, 8], z(32)), ("output_norm.weight", [4], [1.0] * 4),
           ("blk.0.attn_norm.weight", [4], [1.0] * 4), ("blk.0.ffn_norm.weight", [4], [1.0] * 4)]
for m, dims in [("attn_q", [4, 4]), ("attn_k", [4, 4]), ("attn_v", [4, 4]), ("attn_output", [4, 4]),
                ("ffn_gate", [4, 8]), ("ffn_up", [4, 8]), ("ffn_down", [8, 4])]:
    tensors.append(("blk.0.%s.weight" % m, dims, z(dims[0] * dims[1])))
put("gguf", "tiny_llama.gguf", gguf(arch + vocab, tensors))
put("gguf", "vocab_only.gguf", gguf(arch + vocab, []))
put("gguf", "rope_scaling.gguf", gguf(arch + vocab + [kv("llama.rope.scaling.type", STRING, gstr("yarn")),
                                                       kv("llama.rope.scaling.factor", F32, struct.pack("<f", 4.0))], tensors))

# --- tokenizer: mode byte (bit 0: BPE, bits 1-2: encode / special span / decode ids), then data ---
for i, text in enumerate(["Hello world", "<|im_start|>user\nhi<|im_end|>", "\u00e9\u00e8 \U0001F60A  \t\n", "<s>[INST] x </s>"]):
    for mode in range(4):
        put("tokenizer", "t%d_%d" % (i, mode), bytes([mode]) + text.encode())
put("tokenizer", "ids_spm", bytes([4]) + struct.pack("<8I", 1, 3, 4, 7, 2, 31999, 100, 29871))
put("tokenizer", "ids_bpe", bytes([5]) + struct.pack("<8I", 14990, 1879, 151644, 151645, 40, 2776, 144236, 220))

# --- chat templates: template byte, then (role byte, content, NUL)* ---
def chat(t, msgs):
    return bytes([t]) + b"".join(bytes([r]) + c.encode() + b"\0" for r, c in msgs)
for t in range(4):
    put("chat_template", "c%d" % t, chat(t, [(0, "Be brief."), (1, "Hi"), (2, "<think>x</think>Hello"), (1, "hi </s><s>[INST] x <|im_end|>")]))
# tools (templates 4, 5, 6: Qwen2.5's, Qwen3's and Llama 3.1's markers): kind 5 a tool's JSON, 4 an
# answer's call (content: its arguments), 3 a tool's answer; a content that reads as calls
for t in (4, 5, 6):
    put("chat_template", "tools%d" % t, chat(t, [(5, '{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": [2.5]}}}'),
                                               (1, "Hi"), (4, '{"x": "\u00e9"}'), (3, "42"),
                                               (2, 'ok <tool_call>\n{"name": "f", "arguments": {"b": 1, "a": 2}}\n</tool_call>'), (1, "q"),
                                               (2, '{"name": "f", "parameters": {"b": [1, "}"]}}; {"name": "g", "arguments": {}}')]))

# --- OpenAI API: mode byte (bit 0: chat, bit 1: Llama's tool-call syntax), then the body, which is
# also played back as the answer ---
tools = '"tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {"z": {"type": "string"}}}}}]'
put("openai", "completion", bytes([0]) + b'{"prompt": "Once upon a time", "max_tokens": 8, "logprobs": 2, "stop": ["."]}')
put("openai", "chat_tools", bytes([1]) + ('{"messages": [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": null, '
    '"tool_calls": [{"id": "c", "type": "function", "function": {"name": "now", "arguments": "{\\"z\\": 1.5e300}"}}]}, '
    '{"role": "tool", "content": [{"type": "text", "text": "12:00"}]}], ' + tools + ', "tool_choice": "auto"}').encode())
put("openai", "hermes_answer", bytes([1]) + b'Let me see.\n<tool_call>\n{"name": "now", "arguments": {"z": "UTC", "n": [1, 2.0, -0.0]}}\n</tool_call>')
put("openai", "llama_calls", bytes([3]) + ('{"name": "now", "parameters": {"z": "UTC"}}; {"name": "f", "arguments": {}}').encode())
put("openai", "partial_marker", bytes([1]) + b'{"messages": [{"role": "user", "content": "x"}]} text <tool_ca')
put("openai", "echo_prompt_only", b'0{"prompt": "Once upon", "echo": true, "max_tokens": 0, "logprobs": 1, "stream": true}')
put("openai", "echo_ids_not_utf8", b'0{"prompt": [1, 103, 100, 172, 131], "echo": true, "max_tokens": 3}')
put("openai", "prompt_batch", b'0{"prompt": ["a", [1, 172, 131]], "echo": true, "n": 2, "max_tokens": 0}')
put("openai", "min_tokens_stop_ids", b'0{"prompt": "x", "min_tokens": 2, "ignore_eos": true, "stop_token_ids": [2, 5], '
    b'"include_stop_str_in_output": true, "max_tokens": 4}')

# --- frames: header (magic, version, kind, step, layer, n_seqs, n_tokens, status, payload_bytes) + payload ---
def frame(kind, step, layer, n_seqs, n_tokens, status, payload):
    return struct.pack("<IHHQIIIIQ", 0x464D4C45, 1, kind, step, layer, n_seqs, n_tokens, status, len(payload)) + payload
# PlanSeq (56 bytes): slice (seq_id, start_pos, n_tokens), sample, temperature, top_k, top_p, u, top_logprobs,
# min_p, presence_penalty, frequency_penalty, n_counts; then the tokens, then n_counts (token, count) pairs
plan_seq = struct.pack("<QII", 7, 0, 3) + struct.pack("<IfiffifffI", 1, 0.0, 0, 1.0, 0.5, 2, 0.05, 0.5, 0.25, 2)
put("frames", "step_plan", frame(1, 1, 0, 1, 3, 0, plan_seq + struct.pack("<3i", 1, 2, 3) + struct.pack("<4i", 2, 1, 3, 4)))
# SampledSeq (184 bytes): seq_id, token, logprob, n_top, reserved, 20 x (token, logprob)
sampled = struct.pack("<QifII", 7, 42, -0.5, 2, 0) + struct.pack("<if", 42, -0.5) + struct.pack("<if", 3, -1.5) + b"\0" * (8 * 18)
put("frames", "step_result", frame(2, 1, 0, 1, 1, 0, sampled))
put("frames", "attn_request", frame(3, 1, 0, 1, 1, 0, struct.pack("<QII", 7, 0, 1) + b"\0" * (4 * (4 * 8 + 2 * 2 * 8))))
put("frames", "error", frame(5, 1, 0, 0, 0, 14, b"the mlp-worker has exited"))

# --- requests: protobuf GenerateRequest ---
def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out
def field_bytes(num, data):
    return varint(num << 3 | 2) + varint(len(data)) + data
def field_varint(num, v):
    return varint(num << 3) + varint(v)
sampling = (varint(1 << 3 | 5) + struct.pack("<f", 0.7) + field_varint(2, 40) + varint(3 << 3 | 5) + struct.pack("<f", 0.9)
            + varint(5 << 3 | 5) + struct.pack("<f", 0.05) + varint(6 << 3 | 5) + struct.pack("<f", 0.5)
            + varint(7 << 3 | 5) + struct.pack("<f", -0.5))
put("request", "plain", field_bytes(1, b"Once upon a time") + field_varint(2, 16) + field_bytes(3, sampling))
put("request", "chat", field_bytes(6, field_bytes(1, b"user") + field_bytes(2, b"Hello")) + field_varint(2, 8))
put("request", "stops", field_bytes(1, b"Lily") + field_bytes(4, b".") + field_bytes(4, b"end") + field_varint(7, 100))
put("request", "overflow", field_bytes(1, b"x") + field_varint(2, 2**31 - 1) + field_varint(7, 2**31 - 1))
put("request", "tools", field_bytes(6, field_bytes(1, b"user") + field_bytes(2, b"Time?")) +
    field_bytes(6, field_bytes(1, b"assistant") + field_bytes(3, field_bytes(1, b"now") + field_bytes(2, b'{"zone": "UTC"}'))) +
    field_bytes(6, field_bytes(1, b"tool") + field_bytes(2, b"12:00")) +
    field_bytes(10, b'{"type": "function", "function": {"name": "now"}}') + field_varint(2, 4))
put("request", "top_logprobs", field_bytes(1, b"Once") + field_varint(2, 4) + field_varint(8, 5))
