package node

import (
	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/load"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// knownLabels gathers every label value the node's metrics can take, each
// from the package that produces it, so a fresh node's /metrics already has
// every labelled counter at 0.
func knownLabels() metrics.Labels {
	dirs := make([]string, 0, len(backend.Directions))
	for _, d := range backend.Directions {
		dirs = append(dirs, d.String())
	}
	return metrics.Labels{
		Rejected:  messages.RejectLabels,
		Deferrals: sched.DeferLabels(),
		Retries:   sched.RetryLabels(),
		// Not node_lost: an engine concludes it when it loses its node;
		// the node never publishes it (messages.ReasonNodeLost).
		Releases: []string{messages.ReasonFinished, messages.ReasonAborted, messages.ReasonPreempted,
			messages.ReasonEngineReset, messages.ReasonEngineGone},
		TransferTypes: dirs,
		LoadResults:   load.Results,
		LoadWaits:     loadWaitOutcomes,
		Actors:        actors.Kinds,
		PublishKinds:  actors.PublishKinds,
	}
}
