package actors

// Actor kinds: the actor label of kvactors_actor_unexpected_messages_total.
const (
	KindEngine   = "engine"
	KindRequest  = "request"
	KindLoad     = "load"
	KindTransfer = "transfer"
)

// Kinds lists every actor kind (metrics preset the label at 0).
var Kinds = []string{KindEngine, KindRequest, KindLoad, KindTransfer}
