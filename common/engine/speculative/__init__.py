"""Speculative decoding: proposers guess a request's next tokens, one step verifies them all.

    ngram.py        n-gram prompt lookup: the tokens that followed the latest earlier occurrence
                    of the request's last n tokens (no extra weights)
    speculation.py  the scheduler's side: who speculates this step, how many draft tokens, the
                    slots for them, acceptance per request (and backing off where it stays low)
    verify.py       the runner's side: one sampling row per draft position, and the tokens kept
"""
