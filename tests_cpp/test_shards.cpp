// The tar parser, the shard index and its files, the shard source (reads,
// epoch orders, a changed shard) and the file-list parser.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>

#include "loader/sample_source.h"
#include "loader/shard_source.h"
#include "loader/tar_index.h"
#include "test_util.h"

namespace {

using namespace dino_opt::loader;
using Bytes = std::vector<uint8_t>;

Bytes text_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

// A ustar header block; `base256` writes the size in GNU's binary form.
Bytes tar_header(const std::string& name, uint64_t size, char type, const std::string& prefix = "",
                 bool base256 = false) {
  Bytes h(512, 0);
  std::memcpy(h.data(), name.data(), std::min<size_t>(name.size(), 100));
  std::memcpy(h.data() + 100, "0000644", 7);
  std::memcpy(h.data() + 108, "0000000", 7);
  std::memcpy(h.data() + 116, "0000000", 7);
  if (base256) {
    h[124] = 0x80;
    for (int i = 0; i < 8; ++i) h[135 - i] = static_cast<uint8_t>(size >> (8 * i));
  } else {
    std::snprintf(reinterpret_cast<char*>(h.data()) + 124, 12, "%011llo",
                  static_cast<unsigned long long>(size));
  }
  std::memcpy(h.data() + 136, "00000000000", 11);
  h[156] = static_cast<uint8_t>(type);
  std::memcpy(h.data() + 257, "ustar", 6);  // with its NUL: POSIX ustar
  std::memcpy(h.data() + 263, "00", 2);
  std::memcpy(h.data() + 345, prefix.data(), std::min<size_t>(prefix.size(), 155));
  std::memset(h.data() + 148, ' ', 8);
  unsigned sum = 0;
  for (uint8_t b : h) sum += b;
  std::snprintf(reinterpret_cast<char*>(h.data()) + 148, 8, "%06o", sum);
  return h;
}

void add(Bytes& tar, const std::string& name, const Bytes& data, char type = '0',
         const std::string& prefix = "", bool base256 = false) {
  const Bytes h = tar_header(name, data.size(), type, prefix, base256);
  tar.insert(tar.end(), h.begin(), h.end());
  tar.insert(tar.end(), data.begin(), data.end());
  tar.resize((tar.size() + 511) / 512 * 512, 0);
}

std::string pax_record(const std::string& key, const std::string& value) {
  const std::string body = " " + key + "=" + value + "\n";
  size_t n = body.size() + 1;
  while (std::to_string(n).size() + body.size() != n) ++n;
  return std::to_string(n) + body;
}

Bytes finish(Bytes tar) {
  tar.resize(tar.size() + 1024, 0);
  return tar;
}

Bytes payload(int i, size_t n) {
  Bytes b(n);
  for (size_t k = 0; k < n; ++k) b[k] = static_cast<uint8_t>(i * 31 + k * 7);
  return b;
}

TEST(TarScan, ReadsUstarPaxAndGnuNamesAndSkipsOtherTypes) {
  Bytes tar;
  add(tar, "dir/", {}, '5');
  add(tar, "a.jpg", payload(1, 700), '0', "deep/folder");
  const std::string long_name = std::string(150, 'p') + ".png";
  add(tar, "PaxHeaders/x", text_bytes(pax_record("path", long_name)), 'x');
  add(tar, "truncated-name.png", payload(2, 10));
  add(tar, "././@LongLink", text_bytes(std::string(120, 'g') + ".webp" + '\0'), 'L');
  add(tar, "short.webp", payload(3, 1000));
  add(tar, "link.jpg", {}, '2');
  add(tar, "big.jpg", payload(4, 33), '0', "", true);
  const Bytes t = finish(tar);
  const MemoryBytes bytes(t.data(), t.size());
  const auto members = scan_tar(bytes);
  ASSERT_EQ(members.size(), 4u);
  EXPECT_EQ(members[0].name, "deep/folder/a.jpg");
  EXPECT_EQ(members[1].name, long_name);
  EXPECT_EQ(members[2].name, std::string(120, 'g') + ".webp");
  EXPECT_EQ(members[3].name, "big.jpg");
  const size_t sizes[] = {700, 10, 1000, 33};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(members[i].size, sizes[i]);
    EXPECT_EQ(members[i].offset % 512, 0u);
    const Bytes want = payload(i + 1, sizes[i]);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), t.begin() + members[i].offset)) << i;
  }
}

void expect_source_error(const std::function<void()>& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected a SourceError containing " << fragment;
  } catch (const SourceError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(TarScan, TruncatedAndCorruptArchivesNameTheMember) {
  Bytes tar;
  add(tar, "000.jpg", payload(0, 600));
  add(tar, "001.jpg", payload(1, 2000));
  // The second header is at byte 512 + 1024 (the first member's data padded to blocks).
  const Bytes cut(tar.begin(), tar.begin() + 1536 + 512 + 700);
  const MemoryBytes b(cut.data(), cut.size());
  expect_source_error([&] { scan_tar(b); },
                      "truncated tar: member '001.jpg' (header at byte 1536)");
  const Bytes half(tar.begin(), tar.begin() + 1536 + 100);
  const MemoryBytes h(half.data(), half.size());
  expect_source_error([&] { scan_tar(h); }, "header at byte 1536 is cut off");
  Bytes bad = tar;
  bad[1536 + 3] ^= 0x5a;  // a byte of the second header's name
  const MemoryBytes c(bad.data(), bad.size());
  expect_source_error([&] { scan_tar(c); }, "bad checksum");
  const Bytes text = text_bytes(std::string(2048, 'x'));
  const MemoryBytes t(text.data(), text.size());
  expect_source_error([&] { scan_tar(t); }, "not a tar file");
  Bytes pax;
  add(pax, "PaxHeaders/x", text_bytes("99 path=oops\n"), 'x');
  add(pax, "a.jpg", payload(0, 10));
  const Bytes p = finish(pax);
  const MemoryBytes pb(p.data(), p.size());
  expect_source_error([&] { scan_tar(pb); }, "corrupt pax header");
}

TEST(TarScan, SamplesGroupKeysAndTakeTheirLabels) {
  Bytes tar;
  add(tar, "a.cls", text_bytes("3\n"));
  add(tar, "a.jpg", payload(0, 50));
  add(tar, "a.png", payload(1, 50));  // a second image of key a: not a sample
  add(tar, "b.PNG", payload(2, 60));
  add(tar, "c.txt", payload(3, 5));
  add(tar, "d.cls", text_bytes("9"));      // no image
  add(tar, "x/e.seg.png", payload(4, 5));  // field "seg.png": not an image
  const Bytes t = finish(tar);
  const MemoryBytes bytes(t.data(), t.size());
  const ShardIndex index = shard_samples(scan_tar(bytes), bytes);
  ASSERT_EQ(index.entries.size(), 2u);
  EXPECT_EQ(index.names, (std::vector<std::string>{"a.jpg", "b.PNG"}));
  EXPECT_EQ(index.entries[0].label, 3);
  EXPECT_EQ(index.entries[1].label, -1);
  EXPECT_EQ(index.entries[1].size, 60u);
  EXPECT_EQ(split_member_name("dir.v1/k.ey.JPG"),
            (std::pair<std::string, std::string>{"dir.v1/k", "ey.jpg"}));
  Bytes bad;
  add(bad, "z.jpg", payload(0, 5));
  add(bad, "z.cls", text_bytes("cat"));
  const Bytes b = finish(bad);
  const MemoryBytes bb(b.data(), b.size());
  expect_source_error([&] { shard_samples(scan_tar(bb), bb); }, "member 'z.cls'");
}

class Shards : public ::testing::Test {
 protected:
  void SetUp() override {
    int sample = 0;
    for (int s = 0; s < 3; ++s) {
      Bytes tar;
      for (int k = 0; k < 3 + 2 * s; ++k, ++sample) {
        const std::string key = std::to_string(sample);
        add(tar, key + ".jpg", payload(sample, 100 + 37 * sample));
        add(tar, key + ".cls", text_bytes(std::to_string(sample % 4)));
        contents_.push_back(payload(sample, 100 + 37 * sample));
      }
      paths_.push_back(dir_ / ("shard-" + std::to_string(s) + ".tar"));
      dino_opt::testing::write_file(paths_.back(), finish(tar));
      candidates_.push_back({paths_.back() + ".idx"});
    }
  }
  std::shared_ptr<ShardSource> open(ShardSourceOptions o = {}) {
    return std::make_shared<ShardSource>(paths_, candidates_, o);
  }

  dino_opt::testing::TempDir dir_{"dino_opt_shards_test"};
  std::vector<std::string> paths_;
  std::vector<std::vector<std::string>> candidates_;
  std::vector<Bytes> contents_;
};

TEST_F(Shards, IndexFilesRoundTripAndDamageMeansRebuild) {
  const auto source = open();
  EXPECT_EQ(source->size(), 15);
  EXPECT_EQ(source->index_report().built, 3);
  EXPECT_EQ(source->index_report().written, 3);
  const auto index = read_shard_index(paths_[1] + ".idx", true);
  ASSERT_TRUE(index.has_value());
  EXPECT_EQ(index->entries.size(), 5u);
  EXPECT_EQ(index->names[2], "5.jpg");
  EXPECT_EQ(index_member_name(paths_[1] + ".idx", 4), "7.jpg");
  EXPECT_EQ(source->describe(7), paths_[1] + ": 7.jpg");
  EXPECT_EQ(open()->index_report().loaded, 3);
  // One flipped byte: the checksum refuses the file, and the shard is indexed again.
  std::fstream f(paths_[2] + ".idx", std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(50);
  f.put('\x7f');
  f.close();
  EXPECT_FALSE(read_shard_index(paths_[2] + ".idx", false).has_value());
  const auto again = open();
  EXPECT_EQ(again->index_report().loaded, 2);
  EXPECT_EQ(again->index_report().built, 1);
}

TEST_F(Shards, ReadsGiveTheMembersAndLabels) {
  const auto source = open();
  std::vector<uint8_t> out;
  for (int64_t i = 0; i < source->size(); ++i) {
    source->read(i, -1, out);
    EXPECT_EQ(out, contents_[i]) << i;
    EXPECT_EQ(source->label(i), i % 4);
  }
}

TEST_F(Shards, EpochOrdersCoverEverySampleOnceAcrossRanks) {
  const auto source = open();
  for (bool pad : {true, false}) {
    for (int world : {1, 2, 4}) {
      const int64_t n = source->size();
      const int64_t per_rank = pad ? (n + world - 1) / world : n / world;
      std::vector<int64_t> all;
      for (int rank = 0; rank < world; ++rank) {
        OrderOptions o{7, rank, world, true, per_rank, 4};
        const auto order = source->epoch_order(o, 3);
        ASSERT_EQ(static_cast<int64_t>(order.size()), per_rank);
        EXPECT_EQ(order, source->epoch_order(o, 3));  // a pure function
        all.insert(all.end(), order.begin(), order.end());
      }
      std::map<int64_t, int> seen;
      for (int64_t i : all) ++seen[i];
      if (pad) {
        EXPECT_EQ(static_cast<int64_t>(seen.size()), n);  // every sample, the padding repeats
        EXPECT_EQ(static_cast<int64_t>(all.size()) - n, (world - n % world) % world);
      } else {
        EXPECT_EQ(seen.size(), all.size());  // none twice
      }
    }
  }
  OrderOptions o{7, 0, 1, true, source->size(), 4};
  EXPECT_NE(source->epoch_order(o, 0), source->epoch_order(o, 1));
  o.shuffle = false;
  std::vector<int64_t> in_order(source->size());
  std::iota(in_order.begin(), in_order.end(), int64_t{0});
  EXPECT_EQ(source->epoch_order(o, 5), in_order);
}

TEST_F(Shards, ExactShardsAreContiguousRunsOfTheDataSetInOrder) {
  const auto source = open();
  const int64_t n = source->size();  // 15
  for (int world : {1, 2, 4, 16}) {
    std::vector<int64_t> all;
    for (int rank = 0; rank < world; ++rank) {
      const int64_t per_rank = n / world + (rank < n % world ? 1 : 0);
      OrderOptions o{7, rank, world, false, per_rank, 4};
      o.first = rank * (n / world) + std::min<int64_t>(rank, n % world);
      const auto order = source->epoch_order(o, 0);
      ASSERT_EQ(static_cast<int64_t>(order.size()), per_rank);
      all.insert(all.end(), order.begin(), order.end());
    }
    std::vector<int64_t> in_order(n);
    std::iota(in_order.begin(), in_order.end(), int64_t{0});
    EXPECT_EQ(all, in_order) << "world " << world;  // rank after rank: the data set once
  }
}

TEST_F(Shards, PlannedReadsComeFromLargeSequentialReads) {
  ShardSourceOptions options;
  options.read_block = 4096;
  const auto source = open(options);
  OrderOptions o{1, 0, 1, true, source->size(), 4};
  auto order = std::make_shared<const std::vector<int64_t>>(source->epoch_order(o, 0));
  for (int64_t first : {int64_t{0}, int64_t{6}}) {
    const ReadStats before = source->read_stats();
    source->begin_epoch(o, order, first, source->size());
    std::vector<uint8_t> out;
    for (int64_t p = first; p < source->size(); ++p) {
      source->read((*order)[p], p, out);
      EXPECT_EQ(out, contents_[(*order)[p]]) << p;
    }
    const ReadStats after = source->read_stats();
    // Each window reads a few extents, not one read per member.
    EXPECT_LT(after.reads - before.reads, source->size() - first);
    EXPECT_GT(after.bytes - before.bytes, 0);
  }
  source->stop();
  std::vector<uint8_t> out;
  source->read(3, 0, out);  // after stop: a direct read
  EXPECT_EQ(out, contents_[3]);
}

TEST_F(Shards, AChangedShardIsNamedAndIndexedAnew) {
  const auto source = open();
  {
    std::ofstream grow(paths_[0], std::ios::app | std::ios::binary);
    grow << std::string(512, '\0');
  }
  std::vector<uint8_t> out;
  expect_source_error([&] { source->read(0, -1, out); }, "changed since its index was built");
  EXPECT_EQ(open()->index_report().built, 1);
  expect_source_error([&] { ShardSource(std::vector<std::string>{dir_ / "missing.tar"}, {{}}); },
                      "missing.tar: cannot open");
}

TEST(FileLists, TextAndCsvWithLabelsOrClassNames) {
  dino_opt::testing::TempDir dir("dino_opt_list_test");
  std::ofstream(dir / "list.txt")
      << "# a comment\na/1.jpg 3\n\nb/2.jpg\t7\n/abs/3.jpg\nmy pic.jpg\t2\n";
  const FileList text = read_file_list(dir / "list.txt", "/root");
  ASSERT_EQ(text.source->size(), 4);
  EXPECT_TRUE(text.classes.empty());
  EXPECT_EQ(text.source->path(0), "/root/a/1.jpg");
  EXPECT_EQ(text.source->path(2), "/abs/3.jpg");
  EXPECT_EQ(text.source->path(3), "/root/my pic.jpg");
  EXPECT_EQ(text.source->label(1), 7);
  EXPECT_EQ(text.source->label(2), -1);
  std::ofstream(dir / "list.csv") << "label,path\ndog,x.jpg\ncat,\"y, z.jpg\"\r\ndog,w.jpg\n";
  const FileList csv = read_file_list(dir / "list.csv", "");
  ASSERT_EQ(csv.source->size(), 3);
  EXPECT_EQ(csv.classes, (std::vector<std::string>{"cat", "dog"}));
  EXPECT_EQ(csv.source->path(1), "y, z.jpg");
  EXPECT_EQ(csv.source->label(0), 1);
  EXPECT_EQ(csv.source->label(1), 0);
  std::ofstream(dir / "bad.csv") << "path,label\n\"open.jpg,1\n";
  expect_source_error([&] { read_file_list(dir / "bad.csv", ""); }, "line 2: a quoted field");
  std::ofstream(dir / "empty.txt") << "# nothing\n";
  expect_source_error([&] { read_file_list(dir / "empty.txt", ""); }, "names no image");
}

}  // namespace
