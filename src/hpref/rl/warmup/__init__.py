"""The cached supervised warm-up that makes the policies' starting checkpoint (`supervised`): tiny ones
on the synthetic arena's answers, or every one on the user's (`data`: `[rl.warmup] path`)."""
