//go:build !unix

package embedded

// nowhere is, off unix, a loopback port freed again (a later listener may
// take it; unix holds it bound, see nowhere_unix.go).
type nowhere struct{ port int }

func reserveNowhere() (*nowhere, error) {
	p, err := freePorts(1)
	if err != nil {
		return nil, err
	}
	return &nowhere{port: p[0]}, nil
}

func (n *nowhere) release() {}
