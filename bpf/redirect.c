//go:build ignore

// SPDX-License-Identifier: Apache-2.0

// The datapath of CFP-32759: TCP of enrolled pods is steered, in the kernel,
// to the node's mTLS agent. Two programs share one map of addresses
// (redirect_map; from_pod also keeps proxied_map, its connections):
//
//   from_pod      TCX ingress of a local pod's host-side interface (packets
//                 the pod sends). New connections of an enrolled pod to an
//                 address that is not on this node go to the agent, and so
//                 does the rest of every connection the agent holds.
//   node_ingress  TCX ingress of the node's uplinks (packets from other
//                 nodes). HBONE (port 15008) to a local enrolled pod, and
//                 replies to connections the agent opened in that pod's name,
//                 go to the agent. node_ingress_l3 does the same on devices
//                 without an Ethernet header (Cilium's WireGuard device).
//
// Steering = rewrite the destination MAC to the agent's and bpf_redirect to
// the agent's host-side interface: the packet keeps its IP header, so the
// agent sees the original destination.
//
// Everything the programs do not steer continues down the TCX chain
// unchanged (TC_ACT_UNSPEC is TCX_NEXT in kernels >= 6.6; the 6.1 UAPI
// headers of the build machine do not name it).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#define HBONE_PORT 15008
#define MAX_IPV6_EXT_HEADERS 4
// IPv6 extension headers the UAPI headers do not name (RFC 7045's list).
#define IPPROTO_MOBILITY 135
#define IPPROTO_HIP 139
#define IPPROTO_SHIM6 140
#define IP_FRAG_OFFSET_MASK 0x1fff

// What a redirect map entry says about its address.
enum redirect_kind {
	// A local address that is not enrolled: a destination on this node.
	REDIRECT_KIND_LOCAL = 1,
	// A local enrolled pod.
	REDIRECT_KIND_ENROLLED = 2,
	// The node's mTLS agent; only under the all-zero key.
	REDIRECT_KIND_AGENT = 3,
};

// An IPv6 address; IPv4 addresses are IPv4-mapped (::ffff:a.b.c.d). The
// all-zero address (::) is never a pod address: it keys the mTLS agent.
struct redirect_key {
	__u8 addr[16];
};

struct redirect_value {
	// Host-side interface in the node's network namespace.
	__u32 ifindex;
	// For the agent: the id of its network namespace as the node sees it
	// (IFLA_LINK_NETNSID of its interface), or -1 when unknown.
	__s32 netns_id;
	enum redirect_kind kind;
	// MAC address of the interface on the pod's (agent's) side.
	__u8 mac[ETH_ALEN];
	__u16 pad;
};

// Written only by root from user space (pinned 0600), read-only to programs.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct redirect_key);
	__type(value, struct redirect_value);
	__uint(map_flags, BPF_F_RDONLY_PROG);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} redirect_map SEC(".maps");

// A connection as its pod sends it.
struct conn_key {
	struct redirect_key src;
	struct redirect_key dst;
	__be16 sport;
	__be16 dport;
};

// The connections of the pod that an agent held, as the pod sends them:
// those the pod opened through the agent, and those the agent opened to the
// pod in a remote client's name (inbound HBONE). A later packet of one that
// no agent holds any more (the agent is gone, or came back in a new network
// namespace) is dropped: the pod's peer was the agent, and passing the
// packet on would send its payload in clear to the real destination (say
// the next request on a pooled HTTP connection). A new connection with the
// same 4-tuple starts with a SYN (outbound), which replaces the entry, or
// with the pod's SYN-ACK, which ends an inbound entry only: the pod answers
// a SYN on a connection it opened itself too (simultaneous open), and an
// outbound entry never ends that way. LRU: the entries of closed
// connections age out. Pinned, so that a restarted node agent keeps them.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct conn_key);
	__type(value, __u8); // enum proxied
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} proxied_map SEC(".maps");

// Who opened a connection of proxied_map.
enum proxied {
	// The pod, through the agent; also an entry put back after LRU
	// evicted it (the direction is not known then: the stricter one).
	PROXIED_BY_POD = 1,
	// The agent, to the pod, in a remote client's name: the entry was
	// written at the pod's SYN-ACK.
	PROXIED_BY_AGENT = 2,
};

// The parts of a packet the decisions need.
struct flow {
	struct redirect_key src;
	struct redirect_key dst;
	__be16 sport;
	__be16 dport;
	__u8 ipv6;
	__u8 has_ports; // false for non-first fragments
	__u8 syn;       // SYN without ACK: the first packet of a connection
	__u8 synack;    // SYN with ACK: the answer to a peer's first packet
};

static __always_inline void map_ipv4(struct redirect_key *key, __be32 addr)
{
	__builtin_memset(key->addr, 0, 10);
	key->addr[10] = 0xff;
	key->addr[11] = 0xff;
	__builtin_memcpy(&key->addr[12], &addr, 4);
}

// What parse found.
enum parsed {
	PARSED_OTHER = 0,  // not TCP
	PARSED_TCP = 1,    // TCP; ports only when f->has_ports
	PARSED_UNSURE = 2, // IP, but the transport could not be reached
};

// pull_headers makes the headers direct packet access reads linear, for the
// rare packet whose linear part is shorter (e.g. built from fragments).
static __always_inline void pull_headers(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	__u32 want = skb->len < 128 ? skb->len : 128;

	if (data + want > data_end)
		bpf_skb_pull_data(skb, want);
}

// ipv6_ext reports whether an IPv6 next header value is an extension
// header, which another header, maybe TCP, may follow.
static __always_inline int ipv6_ext(__u8 next)
{
	switch (next) {
	case IPPROTO_HOPOPTS:
	case IPPROTO_ROUTING:
	case IPPROTO_FRAGMENT:
	case IPPROTO_DSTOPTS:
	case IPPROTO_AH:
	case IPPROTO_MOBILITY:
	case IPPROTO_HIP:
	case IPPROTO_SHIM6:
		return 1;
	}
	return 0;
}

// parse fills f with the addresses and, for TCP, the ports. A packet of an
// L3 device (l3: WireGuard's, a tun) starts with its IP header, the
// protocol in skb->protocol; others with an Ethernet header.
static __always_inline enum parsed parse(struct __sk_buff *skb, struct flow *f, const int l3)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	void *network = data;
	__be16 proto = skb->protocol;
	void *l4;

	if (!l3) {
		struct ethhdr *eth = data;

		if ((void *)(eth + 1) > data_end)
			return PARSED_OTHER;
		proto = eth->h_proto;
		network = eth + 1;
	}

	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = network;

		if ((void *)(ip + 1) > data_end || ip->ihl < 5)
			return PARSED_OTHER;
		if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_AH)
			return PARSED_OTHER;
		map_ipv4(&f->src, ip->saddr);
		map_ipv4(&f->dst, ip->daddr);
		f->ipv6 = 0;
		if (ip->frag_off & bpf_htons(IP_FRAG_OFFSET_MASK)) {
			// A later fragment: no ports, and behind AH maybe TCP.
			return ip->protocol == IPPROTO_TCP ? PARSED_TCP : PARSED_UNSURE;
		}
		l4 = (void *)ip + ip->ihl * 4;
		if (ip->protocol == IPPROTO_AH) {
			// An authentication header authenticates, it does not
			// encrypt: TCP behind it is TCP in clear.
			struct {
				__u8 next;
				__u8 len;
			} *ah = l4;

			if ((void *)(ah + 1) > data_end)
				return PARSED_UNSURE;
			if (ah->next != IPPROTO_TCP)
				return PARSED_OTHER;
			l4 += (ah->len + 2) * 4;
		}
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = network;
		__u8 next;

		if ((void *)(ip6 + 1) > data_end)
			return PARSED_OTHER;
		__builtin_memcpy(f->src.addr, &ip6->saddr, 16);
		__builtin_memcpy(f->dst.addr, &ip6->daddr, 16);
		f->ipv6 = 1;
		next = ip6->nexthdr;
		l4 = ip6 + 1;
		// Extension headers are skipped up to a bound; past it the
		// packet is reported unsure, so that they cannot carry an
		// enrolled pod's TCP past the program.
#pragma unroll
		for (int i = 0; i <= MAX_IPV6_EXT_HEADERS; i++) {
			struct {
				__u8 next;
				__u8 len;
				__be16 frag_off; // fragment header only
			} *ext = l4;

			if (!ipv6_ext(next))
				break;
			if (i == MAX_IPV6_EXT_HEADERS || (void *)(ext + 1) > data_end)
				return PARSED_UNSURE;
			if (next == IPPROTO_FRAGMENT) {
				if (ext->frag_off & bpf_htons(0xfff8)) {
					// A later fragment: no ports. Headers that
					// follow this one are in the first
					// fragment, and may hide TCP behind them.
					if (ext->next == IPPROTO_TCP)
						return PARSED_TCP;
					return ipv6_ext(ext->next) ? PARSED_UNSURE : PARSED_OTHER;
				}
				next = ext->next;
				l4 += 8;
				continue;
			}
			// AH counts its length in 4-byte units, less 2; the
			// others in 8-byte units, less 1.
			if (next == IPPROTO_AH)
				l4 += (ext->len + 2) * 4;
			else
				l4 += (ext->len + 1) * 8;
			next = ext->next;
		}
		if (next != IPPROTO_TCP)
			return PARSED_OTHER;
	} else {
		return PARSED_OTHER;
	}

	struct tcphdr *tcp = l4;
	if ((void *)(tcp + 1) > data_end)
		return PARSED_TCP; // truncated: no ports
	f->sport = tcp->source;
	f->dport = tcp->dest;
	f->has_ports = 1;
	f->syn = tcp->syn && !tcp->ack;
	f->synack = tcp->syn && tcp->ack;
	return PARSED_TCP;
}

static __always_inline struct redirect_value *lookup(struct redirect_key *key)
{
	return bpf_map_lookup_elem(&redirect_map, key);
}

static __always_inline struct redirect_value *agent(void)
{
	struct redirect_key key = {};
	struct redirect_value *v = lookup(&key);

	if (!v || v->kind != REDIRECT_KIND_AGENT)
		return 0;
	return v;
}

// steer hands the packet to the agent's interface, addressed to its MAC.
// The MAC is written directly rather than through bpf_skb_store_bytes: a
// helper call and its checks cost about as much as a map lookup, a fifth
// of the redirect path. (A direct write makes the verifier add a prologue
// that unclones a cloned skb, e.g. under a packet capture on the
// interface, before the program runs, as the helper did only for
// redirected packets.)
static __always_inline int steer(struct __sk_buff *skb, struct redirect_value *to)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return TC_ACT_SHOT;
	__builtin_memcpy(eth->h_dest, to->mac, ETH_ALEN);
	return bpf_redirect(to->ifindex, 0);
}

// steer_l3 hands a packet of an L3 device, which has no Ethernet header, to
// the agent's interface, an Ethernet device: a header addressed to the
// agent is pushed first (bpf_redirect drops a packet without one there).
static __always_inline int steer_l3(struct __sk_buff *skb, struct redirect_value *to)
{
	__be16 proto = skb->protocol;
	void *data, *data_end;
	struct ethhdr *eth;

	if (bpf_skb_change_head(skb, ETH_HLEN, 0))
		return TC_ACT_SHOT;
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	eth = data;
	if ((void *)(eth + 1) > data_end)
		return TC_ACT_SHOT;
	__builtin_memcpy(eth->h_dest, to->mac, ETH_ALEN);
	__builtin_memset(eth->h_source, 0, ETH_ALEN);
	eth->h_proto = proto;
	return bpf_redirect(to->ifindex, 0);
}

// agent_owns reports whether the agent's network namespace has a connection
// for this packet: one it accepted transparently (it holds the original
// destination as its own address), or one it opened with the pod's address
// as source. Both look alike to the lookup: the packet's source and
// destination are the socket's peer and local address.
static __always_inline int agent_owns(struct __sk_buff *skb, struct flow *f, struct redirect_value *to)
{
	struct bpf_sock_tuple tuple = {};
	struct bpf_sock *sk;
	__u32 size;
	int owned;

	if (to->netns_id < 0)
		return 0;
	if (f->ipv6) {
		__builtin_memcpy(tuple.ipv6.saddr, f->src.addr, 16);
		__builtin_memcpy(tuple.ipv6.daddr, f->dst.addr, 16);
		tuple.ipv6.sport = f->sport;
		tuple.ipv6.dport = f->dport;
		size = sizeof(tuple.ipv6);
	} else {
		__builtin_memcpy(&tuple.ipv4.saddr, &f->src.addr[12], 4);
		__builtin_memcpy(&tuple.ipv4.daddr, &f->dst.addr[12], 4);
		tuple.ipv4.sport = f->sport;
		tuple.ipv4.dport = f->dport;
		size = sizeof(tuple.ipv4);
	}
	// skc: a connection still in its handshake is a request socket, which
	// the full-socket lookup would hide behind its listener.
	sk = bpf_skc_lookup_tcp(skb, &tuple, size, (__u32)to->netns_id, 0);
	if (!sk)
		return 0;
	// A listener matches any peer: only a connection proves ownership.
	owned = sk->state != BPF_TCP_LISTEN;
	bpf_sk_release(sk);
	return owned;
}

static __always_inline void conn_of(struct flow *f, struct conn_key *k)
{
	__builtin_memcpy(&k->src, &f->src, sizeof(k->src));
	__builtin_memcpy(&k->dst, &f->dst, sizeof(k->dst));
	k->sport = f->sport;
	k->dport = f->dport;
}

SEC("tcx/ingress")
int from_pod(struct __sk_buff *skb)
{
	struct flow f = {};
	struct redirect_value *src, *to;
	enum parsed parsed;

	pull_headers(skb);
	parsed = parse(skb, &f, 0);
	if (parsed == PARSED_OTHER)
		return TC_ACT_UNSPEC;
	src = lookup(&f.src);
	if (!src || src->kind != REDIRECT_KIND_ENROLLED)
		return TC_ACT_UNSPEC;
	// Only the pod's own interface speaks for its address: a packet that
	// claims an enrolled source elsewhere (including the agent's
	// interface, where the agent sends in the pod's name) is not steered.
	if (src->ifindex != skb->ingress_ifindex)
		return TC_ACT_UNSPEC;
	// Same-node traffic is not proxied.
	if (lookup(&f.dst))
		return TC_ACT_UNSPEC;
	// What might be TCP but cannot be read never leaves unproxied.
	if (parsed == PARSED_UNSURE)
		return TC_ACT_SHOT;
	to = agent();
	// Fail closed: an enrolled pod never opens a cross-node connection in
	// plaintext because the agent is not there yet, and a packet whose
	// connection cannot be told (no ports) never leaves unproxied.
	if (!f.has_ports)
		return to ? steer(skb, to) : TC_ACT_SHOT;
	struct conn_key conn = {};
	__u8 by = PROXIED_BY_POD, *held;

	conn_of(&f, &conn);
	if (f.syn) {
		// Recorded even when no agent is there to take it: the pod's
		// SYN-ACK to a SYN from the destination (a simultaneous open)
		// would otherwise start the connection in clear. A retransmitted
		// SYN finds its entry and leaves it (the lookup marks it used):
		// replacing it would cycle LRU nodes through the shared free list.
		held = bpf_map_lookup_elem(&proxied_map, &conn);
		if (!held || *held != PROXIED_BY_POD)
			bpf_map_update_elem(&proxied_map, &conn, &by, BPF_ANY);
		return to ? steer(skb, to) : TC_ACT_SHOT;
	}
	// Later packets follow their connection: to the agent if it holds it;
	// dropped if an agent held it once; else straight on (replies to
	// plaintext clients of the pod, and connections older than the
	// redirect).
	if (to && agent_owns(skb, &f, to)) {
		// Written once, at the SYN, the entry would be the first LRU
		// evicts from a long-lived connection: the lookup marks it used,
		// and an entry evicted all the same comes back. The pod's SYN-ACK
		// says the agent opened the connection, whatever an entry of an
		// earlier connection on the 4-tuple said.
		if (f.synack) {
			by = PROXIED_BY_AGENT;
			bpf_map_update_elem(&proxied_map, &conn, &by, BPF_ANY);
		} else if (!bpf_map_lookup_elem(&proxied_map, &conn)) {
			bpf_map_update_elem(&proxied_map, &conn, &by, BPF_ANY);
		}
		return steer(skb, to);
	}
	held = bpf_map_lookup_elem(&proxied_map, &conn);
	if (!held)
		return TC_ACT_UNSPEC;
	// The pod accepting a new plaintext connection where the agent once
	// connected to it: that connection is over. A SYN-ACK on a connection
	// the pod opened through the agent answers a SYN from someone else
	// (simultaneous open): never in clear.
	if (f.synack && *held == PROXIED_BY_AGENT) {
		bpf_map_delete_elem(&proxied_map, &conn);
		return TC_ACT_UNSPEC;
	}
	return TC_ACT_SHOT;
}

// node_ingress_on steers what node_ingress and node_ingress_l3 steer.
static __always_inline int node_ingress_on(struct __sk_buff *skb, const int l3)
{
	struct flow f = {};
	struct redirect_value *dst, *to;

	pull_headers(skb);
	if (parse(skb, &f, l3) != PARSED_TCP || !f.has_ports)
		return TC_ACT_UNSPEC;
	dst = lookup(&f.dst);
	if (!dst || dst->kind != REDIRECT_KIND_ENROLLED)
		return TC_ACT_UNSPEC;
	to = agent();
	if (!to)
		return TC_ACT_UNSPEC;
	if (f.dport == bpf_htons(HBONE_PORT) || agent_owns(skb, &f, to))
		return l3 ? steer_l3(skb, to) : steer(skb, to);
	return TC_ACT_UNSPEC;
}

SEC("tcx/ingress")
int node_ingress(struct __sk_buff *skb)
{
	return node_ingress_on(skb, 0);
}

// node_ingress_l3 is node_ingress for devices without an Ethernet header,
// as Cilium's WireGuard device, where packets from other nodes arrive
// decrypted in native routing.
SEC("tcx/ingress")
int node_ingress_l3(struct __sk_buff *skb)
{
	return node_ingress_on(skb, 1);
}

char __license[] SEC("license") = "Apache-2.0";
