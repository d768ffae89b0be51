"""Prefill/decode disaggregation between engine servers (docs/disaggregation.md).

    router ──OpenAI request + X-Specdeploy-Prefill-Url──► decode server
    decode server: tokenize, take the prompt's KV slots and a metadata row (runner.receive)
                   ──POST /disagg/prefill {room, prompt ids, sampling, where to write}──► prefill server
    prefill server: prefill (target + draft extend), first token; write KV and the metadata row
                    into the decode server's memory through Mooncake; answer 200
    decode server: activate the request from the metadata row, decode, stream to the router

prefill.py is the prefill server's side, decode.py the decode server's, protocol.py what both
agree on (the wire format and the compatibility check), router.py the OpenAI front.
"""
