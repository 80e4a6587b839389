// Package load is the load actor: one short-lived actor per P.E.load request.
// It submits the host→device copy to the transfer actor, unpins the keys when
// the copy is done, answers the engine, and stops. One actor per load keeps
// loads of different requests independent of each other and of the engine's
// event stream (vLLM #44294 lost 12x TTFT to loads serialised behind
// unrelated work).
package load
