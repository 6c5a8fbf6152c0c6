package dataplane

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/xdproxy/xdproxy/dataplane/service"
	"github.com/xdproxy/xdproxy/nat/conntrack"
	"github.com/xdproxy/xdproxy/nat/packet"
)

// TestConcurrentBothDirections runs several processors, as several workers
// would, over both directions of many flows while another goroutine keeps
// swapping service tables. Client packets and backend replies of one flow
// go to different processors on purpose. Run it with -race.
func TestConcurrentBothDirections(t *testing.T) {
	const (
		workers = 4
		flows   = 2000
		rounds  = 3
	)
	ct, err := conntrack.New(conntrack.Config{Capacity: 1 << 16})
	if err != nil {
		t.Fatal(err)
	}
	cur := &service.Current{}
	opts := service.CompileOptions{ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("198.18.0.0/16")}}
	cur.Store(service.Compile(testModel(), opts))
	procs := make([]*Processor, workers)
	for i := range procs {
		procs[i] = NewProcessor(ProcessorConfig{Services: cur, Conntrack: ct, Affinity: service.NewAffinity(4096),
			SNATPorts:  conntrack.PortRange{First: 20000, Last: 60000},
			SNATSource: func(packet.Addr) (packet.Addr, bool) { return nodeAddr, true }, Seed: uint64(i + 1)})
	}
	stop := make(chan struct{})
	var swaps atomic.Int64
	var swapper sync.WaitGroup
	swapper.Add(1)
	go func() {
		defer swapper.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			cur.Store(service.Compile(testModel(), opts))
			swaps.Add(1)
		}
	}()

	vip := addr("198.19.0.10")
	// Worker w opens the flows f with f%workers == w and hands each
	// translated packet to worker w+1, which answers it as the backend
	// would and processes that reply with its own processor: every flow's
	// two directions meet two processors, concurrently with new flows.
	type sent struct {
		out    packet.Packet
		client packet.Addr
		sport  uint16
	}
	inbox := make([]chan sent, workers)
	for i := range inbox {
		inbox[i] = make(chan sent, 64)
	}
	var wg, openers sync.WaitGroup
	errs := make(chan string, 2*workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		openers.Add(1)
		p := procs[w]
		var mu sync.Mutex // p is used by this worker's two goroutines in turn
		go func(w int) {  // opener
			defer openers.Done()
			for r := 0; r < rounds; r++ {
				for f := w; f < flows; f += workers {
					client := packet.AddrFrom4([4]byte{198, 18, byte(2 + f/250), byte(f % 250)})
					sport := uint16(30000 + r)
					buf := frame(t, packet.ProtoTCP, client, vip, sport, 80, packet.TCPSyn, nil)
					mu.Lock()
					p.BeginBatch(1)
					v := p.Process(buf, int64(r+1))
					mu.Unlock()
					if v.Action != Forward {
						errs <- "client packet not forwarded: " + v.Reason.String()
						return
					}
					var out packet.Packet
					packet.Parse(buf[:v.Len], &out)
					inbox[(w+1)%workers] <- sent{out, client, sport}
				}
			}
		}(w)
		go func(w int) { // replier
			defer wg.Done()
			for s := range inbox[w] {
				out := s.out
				reply := frame(t, packet.ProtoTCP, out.Dst, out.Src, out.DstPort, out.SrcPort, packet.TCPSyn|packet.TCPAck, nil)
				mu.Lock()
				p.BeginBatch(1)
				rv := p.Process(reply, 1)
				mu.Unlock()
				var back packet.Packet
				packet.Parse(reply[:rv.Len], &back)
				if rv.Action != Forward || back.Dst != s.client || back.DstPort != s.sport || back.Src != vip {
					errs <- "reply not translated back to its client"
				}
			}
		}(w)
	}
	openers.Wait()
	for _, c := range inbox {
		close(c)
	}
	wg.Wait()
	close(stop)
	swapper.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	if swaps.Load() == 0 {
		t.Fatal("no table was swapped during the run")
	}
	t.Logf("%d table swaps during %d flows x %d rounds", swaps.Load(), flows, rounds)
}
