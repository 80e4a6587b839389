package actors

import "github.com/asynkron/protoactor-go/actor"

// Observe is a receiver middleware that copies every message an actor
// receives to ch before the actor handles it, for tests that assert on what
// an actor saw (protoactor's NewObserver, with a channel the test reads
// with a deadline). A full channel drops the copy rather than stall the actor.
func Observe(ch chan<- any) actor.ReceiverMiddleware {
	return func(next actor.ReceiverFunc) actor.ReceiverFunc {
		return func(c actor.ReceiverContext, env *actor.MessageEnvelope) {
			select {
			case ch <- env.Message:
			default:
			}
			next(c, env)
		}
	}
}
