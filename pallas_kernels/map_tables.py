"""The quantization maps of bitsandbytes and torchao, bit for bit, as data.

Each table is a map's float32 values written as their hex bits, so that no
float formatting can change a bit: ``dynamic_8bit_signed``,
``dynamic_8bit_unsigned`` and ``dynamic_4bit_signed`` are
``map_codes.dynamic_map(signed, 7 | 3, 8 | 4)`` as torch computes it in
float32 (bitsandbytes' ``create_dynamic_map``); ``linear_4bit_unsigned`` is
Li et al.'s map for the second moment.
"""

from __future__ import annotations

import numpy as np


def _table(hex_bits: str) -> np.ndarray:
  table = np.array([int(word, 16) for word in hex_bits.split()], np.uint32).view(np.float32)
  table.flags.writeable = False
  return table


_DYNAMIC_8BIT_SIGNED_BITS = """
bf7e3333 bf7a999a bf770000 bf736666 bf6fcccd bf6c3333 bf68999a bf650000 bf616666 bf5dcccd
bf5a3333 bf56999a bf530000 bf4f6666 bf4bcccd bf483333 bf44999a bf410000 bf3d6666 bf39cccd
bf363334 bf32999a bf2f0000 bf2b6666 bf27cccd bf243334 bf20999a bf1d0000 bf196666 bf15cccd
bf123334 bf0e999a bf0b0000 bf076666 bf03cccc bf003333 bef93332 bef20000 beeacccc bee3999a
bedc6666 bed53333 bece0000 bec6cccc bebf999a beb86666 beb13333 beaa0000 bea2cccc be9b999a
be946666 be8d3334 be860000 be7d9999 be6f3333 be60cccd be526666 be440000 be35999a be273333
be18cccd be0a6666 bdf80000 bddb3334 bdc9eb85 bdc428f7 bdbe6667 bdb8a3d7 bdb2e148 bdad1eb8
bda75c2a bda1999a bd9bd70a bd96147b bd9051eb bd8a8f5d bd84cccd bd7e147b bd728f5d bd670a3d
bd5b851f bd500000 bd447ae1 bd38f5c3 bd2d70a3 bd21eb85 bd166667 bd0ae148 bcfeb852 bce7ae15
bcd0a3d7 bcb9999a bca28f5d bc8b851f bc68f5c3 bc3ae148 bc1f3b64 bc160418 bc0ccccd bc039581
bbf4bc6a bbe24dd3 bbcfdf3b bbbd70a4 bbab020d bb989374 bb8624dd bb676c8a bb428f5c bb1db22d
baf1a9fc baa7ef9d ba7765ff ba59e83e ba3c6a80 ba1eecc1 ba016f01 b9c7e283 b98ce705 b923d70b
b8ba1f4b b88aefb3 b8378034 b7b24206 b70205ff b65a1a94 b513a3b7 00000000 3513a3b7 365a1a94
370205ff 37b24206 38378034 388aefb3 38ba1f4b 3923d70b 398ce705 39c7e283 3a016f01 3a1eecc1
3a3c6a80 3a59e83e 3a7765ff 3aa7ef9d 3af1a9fc 3b1db22d 3b428f5c 3b676c8a 3b8624dd 3b989374
3bab020d 3bbd70a4 3bcfdf3b 3be24dd3 3bf4bc6a 3c039581 3c0ccccd 3c160418 3c1f3b64 3c3ae148
3c68f5c3 3c8b851f 3ca28f5d 3cb9999a 3cd0a3d7 3ce7ae15 3cfeb852 3d0ae148 3d166667 3d21eb85
3d2d70a3 3d38f5c3 3d447ae1 3d500000 3d5b851f 3d670a3d 3d728f5d 3d7e147b 3d84cccd 3d8a8f5d
3d9051eb 3d96147b 3d9bd70a 3da1999a 3da75c2a 3dad1eb8 3db2e148 3db8a3d7 3dbe6667 3dc428f7
3dc9eb85 3ddb3334 3df80000 3e0a6666 3e18cccd 3e273333 3e35999a 3e440000 3e526666 3e60cccd
3e6f3333 3e7d9999 3e860000 3e8d3334 3e946666 3e9b999a 3ea2cccc 3eaa0000 3eb13333 3eb86666
3ebf999a 3ec6cccc 3ece0000 3ed53333 3edc6666 3ee3999a 3eeacccc 3ef20000 3ef93332 3f003333
3f03cccc 3f076666 3f0b0000 3f0e999a 3f123334 3f15cccd 3f196666 3f1d0000 3f20999a 3f243334
3f27cccd 3f2b6666 3f2f0000 3f32999a 3f363334 3f39cccd 3f3d6666 3f410000 3f44999a 3f483333
3f4bcccd 3f4f6666 3f530000 3f56999a 3f5a3333 3f5dcccd 3f616666 3f650000 3f68999a 3f6c3333
3f6fcccd 3f736666 3f770000 3f7a999a 3f7e3333 3f800000
"""
_DYNAMIC_8BIT_UNSIGNED_BITS = """
00000000 34ae7baa 35500998 360e9b38 3692ccf6 36de4c51 3714e5d5 3783126e 37e171a0 381fe868
384f1800 387e479a 3896bb99 38ae5364 38c5eb31 3906594b 394154ca 397c5049 399ba5e4 39b923a2
39d6a163 39f41f22 3a08ce71 3a178d50 3a264c30 3a350b10 3a43c9ef 3a5288d0 3a6147af 3a70068e
3a7ec56e 3a958106 3aba5e35 3adf3b64 3b020c4a 3b147ae1 3b26e978 3b395810 3b4bc6a7 3b5e3540
3b70a3d7 3b818937 3b8ac082 3b93f7cf 3b9d2f1a 3ba66666 3baf9db2 3bb8d4fd 3bc20c4a 3bcb4395
3bd47ae1 3bddb22e 3be6e978 3bf020c5 3bf9580f 3c0147ae 3c05e354 3c0a7ef9 3c0f1aa0 3c13b645
3c1851eb 3c1ced92 3c218937 3c2f5c2a 3c466667 3c5d70a3 3c747ae2 3c85c28f 3c9147af 3c9ccccd
3ca851eb 3cb3d70b 3cbf5c29 3ccae147 3cd66667 3ce1eb87 3ced70a3 3cf8f5c3 3d023d70 3d080000
3d0dc28f 3d13851f 3d1947af 3d1f0a3d 3d24cccd 3d2a8f5c 3d3051eb 3d36147b 3d3bd70a 3d41999a
3d475c28 3d4d1eb8 3d52e147 3d58a3d7 3d5e6667 3d6428f7 3d69eb87 3d6fae15 3d7570a3 3d7b3333
3d807ae2 3d835c2a 3d863d71 3d891eb8 3d8c0000 3d8ee148 3d91c290 3d94a3d7 3d97851f 3d9a6667
3d9d47af 3da028f6 3da30a3e 3da5eb85 3da8cccd 3dabae15 3dae8f5c 3db170a4 3db451eb 3db73333
3dba147b 3dbcf5c3 3dbfd70b 3dc2b852 3dc5999a 3dc87ae2 3dcb5c29 3dd40000 3de26666 3df0cccd
3dff3333 3e06cccc 3e0e0000 3e153334 3e1c6666 3e23999a 3e2acccc 3e320000 3e393334 3e406666
3e47999a 3e4ecccc 3e560000 3e5d3334 3e646666 3e6b999a 3e72cccc 3e7a0000 3e809999 3e843333
3e87cccd 3e8b6666 3e8f0000 3e92999a 3e963333 3e99cccc 3e9d6666 3ea10000 3ea4999a 3ea83333
3eabcccc 3eaf6666 3eb30000 3eb6999a 3eba3333 3ebdcccc 3ec16666 3ec50000 3ec8999a 3ecc3333
3ecfcccc 3ed36666 3ed70000 3eda999a 3ede3333 3ee1cccc 3ee56666 3ee90000 3eec999a 3ef03333
3ef3cccc 3ef76666 3efb0000 3efe9999 3f01199a 3f02e666 3f04b333 3f068000 3f084ccc 3f0a199a
3f0be666 3f0db334 3f0f8000 3f114ccd 3f13199a 3f14e666 3f16b334 3f188000 3f1a4ccd 3f1c199a
3f1de666 3f1fb334 3f218000 3f234ccd 3f25199a 3f26e666 3f28b334 3f2a8000 3f2c4ccd 3f2e199a
3f2fe666 3f31b334 3f338000 3f354ccd 3f37199a 3f38e666 3f3ab334 3f3c8000 3f3e4ccd 3f40199a
3f41e666 3f43b334 3f458000 3f474ccc 3f49199a 3f4ae666 3f4cb334 3f4e8000 3f504ccc 3f52199a
3f53e666 3f55b334 3f578000 3f594ccc 3f5b199a 3f5ce666 3f5eb334 3f608000 3f624ccc 3f64199a
3f65e666 3f67b334 3f698000 3f6b4ccc 3f6d199a 3f6ee666 3f70b334 3f728000 3f744ccc 3f76199a
3f77e666 3f79b334 3f7b8000 3f7d4ccc 3f7f199a 3f800000
"""
_DYNAMIC_4BIT_SIGNED_BITS = """
bf633333 bf29999a bee00000 be599999 bd9eb852 bd051eb9 bbb43958 00000000 3bb43958 3d051eb9
3d9eb852 3e599999 3ee00000 3f29999a 3f633333 3f800000
"""
CODE_MAPS: dict[str, np.ndarray] = {
  "dynamic_8bit_signed": _table(_DYNAMIC_8BIT_SIGNED_BITS),
  "dynamic_8bit_unsigned": _table(_DYNAMIC_8BIT_UNSIGNED_BITS),
  "dynamic_4bit_signed": _table(_DYNAMIC_4BIT_SIGNED_BITS),
  # Li et al.'s map for the second moment: linear, without zero, so that a
  # small v never decodes to 0 under a square root in a denominator.
  "linear_4bit_unsigned": np.arange(1, 17, dtype=np.float32) / np.float32(16),
}
CODE_MAPS["linear_4bit_unsigned"].flags.writeable = False
