"""Sends the gateway benchmark's chat request N times on one kept-alive
connection (a shared system prompt, a new customer number each time), one
after another; `s` streams. Used by bench/gateway_callgrind.sh.

usage: gateway_load.py PORT N [s]
"""

import http.client
import json
import sys

# The request of `request_body` in gateway/src/bench/gateway.rs (a test there
# checks that these texts are its texts).
SYSTEM = "You are the support assistant of a bicycle shop. Answer questions about repairs, spare parts, opening hours and prices briefly and politely. If you do not know an answer, say so and suggest calling the shop during opening hours."


def main() -> None:
    port, n = int(sys.argv[1]), int(sys.argv[2])
    stream = "s" in sys.argv[3:]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    ok = 0
    for i in range(n):
        question = f"Customer {i} asks: how much does it cost to replace a chain and {i % 5 + 1} brake pads on a road bike?"
        body = json.dumps(
            {
                "model": "bench",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 16,
                "stream": stream,
            }
        )
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        ok += response.status == 200
    print(f"ok {ok} of {n}")
    if ok != n:
        sys.exit(1)


if __name__ == "__main__":
    main()
