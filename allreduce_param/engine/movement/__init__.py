"""Moving blocks between peers: the peer group, fetch channels, the movements of a step
(reduce-scatter, all-gather, relays), and the rendezvous where peers learn each other."""
