"""Independent ICRC reference: recompute each RoCEv2 frame's ICRC with scapy.

Usage: scapy_icrc.py FILE.pcap -> one line per frame: hex ICRC, or '-' if not RoCEv2.
"""
import sys
import logging

logging.getLogger("scapy").setLevel(logging.ERROR)
from scapy.all import rdpcap, raw, Ether, IP, IPv6  # noqa: E402
from scapy.contrib.roce import BTH  # noqa: E402

for pkt in rdpcap(sys.argv[1]):
    e = Ether(raw(pkt))
    if IP in e:
        ip = e[IP]
        l3 = IP(raw(ip)[: ip.len])
    elif IPv6 in e:
        ip = e[IPv6]
        l3 = IPv6(raw(ip)[: 40 + ip.plen])
    else:
        print("-")
        continue
    if BTH not in l3:
        print("-")
        continue
    l3[BTH].icrc = None
    print(raw(l3)[-4:].hex())
