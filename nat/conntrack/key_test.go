package conntrack

import (
	"testing"

	"github.com/xdproxy/xdproxy/nat/packet"
)

func TestKeyPacking(t *testing.T) {
	for _, tu := range []packet.Tuple{
		tup(client, 1, frontend, 65535, packet.ProtoUDP),
		tup(packet.MustParseAddr("2001:db8::1"), 65535, packet.MustParseAddr("ff02::1:2"), 0, packet.ProtoSCTP),
		{},
	} {
		k := packKey(&tu)
		if got := k.tuple(); got != tu {
			t.Errorf("tuple: %v, want %v", got, tu)
		}
		if got := k.reversedTuple(); got != tu.Reverse() {
			t.Errorf("reversedTuple: %v, want %v", got, tu.Reverse())
		}
		if k == (key{}) {
			t.Error("packed key is all zeros")
		}
	}
}
