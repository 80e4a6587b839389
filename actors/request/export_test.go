package request

// RetryDueFor is a retry timer's message as armed by the actor's gen'th
// request (an actor's first request is 1): tests deliver one late.
func RetryDueFor(gen, arm uint32) any { return &RetryDue{gen: gen, arm: arm} }

// WokenRetryDueFor is an early wake-up's message for the arm'th retry of
// the actor's gen'th request (hostpool's room or pending queue sends one).
func WokenRetryDueFor(gen, arm uint32) any { return &RetryDue{gen: gen, arm: arm, woken: true} }
