"""`hpref serve`: an exported judge or reward model as an HTTP service on Ray Serve.

`command` checks the options and deploys, `app` is the Ray Serve deployment (one loaded export per
replica, concurrent requests batched into packed forward passes), `shapes` the request and response
shapes (hpref's /v1/judge and /v1/score, OpenRLHF's /get_reward, miles' and slime's /remote_rm).
Scoring itself is `hpref.builtin.scoring.ExportScorer`, shared with `hpref rl`'s judge reward.
"""
