package node

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// statusPageBytes bounds the requests of one P.E.status reply: half the NATS
// default max_payload (1 MiB), so a page fits any server's limit with room
// for the rest of the reply. A server with a smaller limit gets smaller
// pages (statusBudget).
const statusPageBytes = 512 << 10

// StatusPage says which part of an engine's requests a P.E.status reply
// holds: page Page (from 0) of Pages; TotalRequests counts all of them.
// Truncated means later pages exist: ask again with {"page":Page+1}.
type StatusPage struct {
	Page          int  `json:"page"`
	Pages         int  `json:"pages"`
	TotalRequests int  `json:"total_requests"`
	Truncated     bool `json:"truncated,omitempty"`
}

// statusQuery is the optional body of a P.E.status request.
type statusQuery struct {
	Page int `json:"page"`
}

// decodeStatusQuery reads {"page":k} (an empty body or {} is page 0).
func decodeStatusQuery(data []byte) (int, error) {
	if len(data) == 0 {
		return 0, nil
	}
	var q statusQuery
	if err := json.Unmarshal(data, &q); err != nil {
		return 0, fmt.Errorf("%w: status body: %v", ingest.ErrMalformed, err)
	}
	if q.Page < 0 {
		return 0, fmt.Errorf("%w: status page %d < 0", ingest.ErrOutOfRange, q.Page)
	}
	return q.Page, nil
}

// statusBudget is the most bytes of request snapshots one reply may carry.
func (n *Node) statusBudget() int {
	budget := statusPageBytes
	if mp := int(n.nc.MaxPayload()); mp > 0 {
		budget = min(budget, mp/2)
	}
	return budget
}

// statusAnswer is the reply to a status request for page page, given what
// the gather returned: an error reply when it failed, else statusPage's.
func (n *Node) statusAnswer(st StatusReply, err error, page int) any {
	if err != nil {
		return n.errorReply(err)
	}
	return n.statusPage(st, page)
}

// statusPage cuts st down to page page and makes sure the reply fits the
// server's max_payload: a reply that would not fit becomes an error reply,
// never a publish that fails with only a log line.
func (n *Node) statusPage(st StatusReply, page int) any {
	var err error
	st.Requests, st.StatusPage, err = paginate(st.Requests, page, n.statusBudget())
	if err != nil {
		if errors.Is(err, ingest.ErrOutOfRange) { // the asker's page, not our encoding
			n.rejected(messages.RejectOutOfRange, "status request refused", "engine", st.Engine, "err", err)
		}
		return n.errorReply(err)
	}
	if data, _ := json.Marshal(st); int64(len(data)) > n.nc.MaxPayload() {
		return n.errorReply(fmt.Errorf("status page %d is %d bytes, over the server's max_payload %d",
			page, len(data), n.nc.MaxPayload()))
	}
	return st
}

// paginate splits reqs (sorted by id) greedily into pages of at most budget
// JSON bytes (a request larger than budget gets a page of its own) and
// returns page page. The split depends only on reqs, so asking for pages
// 0, 1, 2… of an unchanged engine reads each request once.
func paginate(reqs []sched.RequestSnapshot, page, budget int) ([]sched.RequestSnapshot, StatusPage, error) {
	p := StatusPage{TotalRequests: len(reqs), Pages: 1}
	start, size := 0, 0
	var bounds [][2]int
	for i := range reqs {
		b, err := json.Marshal(&reqs[i])
		if err != nil {
			return nil, p, fmt.Errorf("encode request %s: %w", reqs[i].Request, err)
		}
		if size > 0 && size+len(b)+1 > budget {
			bounds = append(bounds, [2]int{start, i})
			start, size = i, 0
		}
		size += len(b) + 1
	}
	bounds = append(bounds, [2]int{start, len(reqs)})
	p.Pages, p.Page = len(bounds), page
	if page >= len(bounds) {
		return nil, p, fmt.Errorf("%w: status page %d: the engine has %d pages", ingest.ErrOutOfRange, page, len(bounds))
	}
	p.Truncated = page < len(bounds)-1
	return reqs[bounds[page][0]:bounds[page][1]], p, nil
}
