// Bucketing must match kohya sd-scripts exactly: the vectors below are the ones kohya's
// make_bucket_resolutions / select_bucket / get_crop_ltrb give (issue #3 lists them).
#include "preprocess/bucket.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/error.h"

namespace lorapipe::preprocess {
namespace {

TEST(BucketKohya, ResolutionsAt512Are17KohyaBuckets) {
  const std::vector<Reso> expected{{256, 832}, {256, 896}, {256, 960}, {256, 1024}, {320, 704},
                                   {320, 768}, {384, 640}, {448, 576}, {512, 512},  {576, 448},
                                   {640, 384}, {704, 320}, {768, 320}, {832, 256},  {896, 256},
                                   {960, 256}, {1024, 256}};
  EXPECT_EQ(make_bucket_resolutions({512, 512}, 256, 1024, 64), expected);
}

TEST(BucketKohya, SelectsNearestAspectAndCoverSize) {
  BucketSelector selector(BucketOptions{});
  struct Case {
    int w, h;
    Reso bucket, resized;
  };
  for (const Case& c : {Case{1920, 1080, {640, 384}, {683, 384}},
                        Case{3000, 2000, {640, 384}, {640, 427}},
                        Case{333, 777, {320, 768}, {329, 768}},
                        // An image already at a bucket's size keeps it unchanged.
                        Case{448, 576, {448, 576}, {448, 576}},
                        Case{512, 512, {512, 512}, {512, 512}}}) {
    std::string why;
    const auto choice = selector.select(c.w, c.h, &why);
    ASSERT_TRUE(choice.has_value()) << why;
    EXPECT_EQ(choice->bucket, c.bucket) << c.w << "x" << c.h;
    EXPECT_EQ(choice->resized, c.resized) << c.w << "x" << c.h;
  }
}

TEST(BucketKohya, NoUpscalePath) {
  BucketOptions options;
  options.bucket_no_upscale = true;
  BucketSelector selector(options);
  std::string why;
  auto big = selector.select(1920, 1080, &why);
  ASSERT_TRUE(big.has_value()) << why;
  EXPECT_EQ(big->resized, (Reso{683, 384}));
  EXPECT_EQ(big->bucket, (Reso{640, 384}));
  auto small = selector.select(600, 400, &why);
  ASSERT_TRUE(small.has_value()) << why;
  EXPECT_EQ(small->resized, (Reso{600, 400}));
  EXPECT_EQ(small->bucket, (Reso{576, 384}));
}

TEST(BucketKohya, NoUpscaleRejectsWhereKohyaDividesByZero) {
  BucketOptions options;
  options.bucket_no_upscale = true;
  BucketSelector selector(options);
  std::string why;
  EXPECT_FALSE(selector.select(20000, 20, &why).has_value());
  EXPECT_NE(why.find("round to 0"), std::string::npos) << why;
  why.clear();
  EXPECT_FALSE(selector.select(40, 30, &why).has_value());  // under one step: empty bucket
  EXPECT_NE(why.find("empty"), std::string::npos) << why;
}

TEST(BucketKohya, CropLtrbAndOffset) {
  // kohya get_crop_ltrb(bucket, original size): the image fitted inside the bucket.
  const CropLtrb ltrb = get_crop_ltrb({640, 384}, {1920, 1080});
  EXPECT_DOUBLE_EQ(ltrb.left, 0.0);
  EXPECT_DOUBLE_EQ(ltrb.top, 12.0);
  EXPECT_DOUBLE_EQ(ltrb.right, 640.0);
  EXPECT_DOUBLE_EQ(ltrb.bottom, 372.0);
  // Fractional case: 333x777 in (320,768). The bucket is narrower than the image, so the image
  // fits by width and is letterboxed top and bottom; right/bottom stay fractional as in kohya.
  const CropLtrb portrait = get_crop_ltrb({320, 768}, {333, 777});
  const double fitted_height = 320 / (333.0 / 777);  // 746.67
  EXPECT_DOUBLE_EQ(portrait.left, 0.0);
  EXPECT_DOUBLE_EQ(portrait.top, 10.0);  // floor((768 - 746.67) / 2)
  EXPECT_DOUBLE_EQ(portrait.right, 320.0);
  EXPECT_DOUBLE_EQ(portrait.bottom, 10.0 + fitted_height);
  // The real crop: centred, trim_size // 2 as kohya; random stays inside the slack.
  EXPECT_EQ(crop_offset({683, 384}, {640, 384}).left, 21);
  EXPECT_EQ(crop_offset({683, 384}, {640, 384}).top, 0);
  EXPECT_EQ(crop_offset({683, 384}, {640, 384}, 0.0, 0.0).left, 0);
  EXPECT_EQ(crop_offset({683, 384}, {640, 384}, 0.999999, 0.5).left, 43);
}

TEST(BucketKohya, WithoutBucketsEveryImageGoesToTheResolution) {
  BucketOptions options;
  options.enable_bucket = false;
  options.resolution = {768, 512};
  BucketSelector selector(options);
  std::string why;
  const auto choice = selector.select(1000, 1000, &why);
  ASSERT_TRUE(choice.has_value());
  EXPECT_EQ(choice->bucket, (Reso{768, 512}));
  EXPECT_EQ(choice->resized, (Reso{768, 768}));
}

// kohya rounds min_bucket_reso down and max_bucket_reso up to the step before making buckets:
// 300 and 1000 with step 64 give the buckets of 256 and 1024.
TEST(BucketKohya, MinAndMaxRoundToTheStepFirst) {
  BucketOptions options;
  options.min_bucket_reso = 300;
  options.max_bucket_reso = 1000;
  EXPECT_EQ(BucketSelector(options).predefined(),
            make_bucket_resolutions({512, 512}, 256, 1024, 64));
  const BucketOptions adjusted = adjusted_to_steps(options);
  EXPECT_EQ(adjusted.min_bucket_reso, 256);
  EXPECT_EQ(adjusted.max_bucket_reso, 1024);
}

TEST(BucketKohya, ParsesResolutionAndRefusesBadOptions) {
  EXPECT_EQ(parse_resolution("512"), (Reso{512, 512}));
  EXPECT_EQ(parse_resolution("768,512"), (Reso{768, 512}));
  for (const char* bad : {"", "abc", "512,", "0", "-5", "512x512"}) {
    EXPECT_THROW(parse_resolution(bad), InputError) << bad;
  }
  BucketOptions options;
  options.max_bucket_reso = 256;
  options.min_bucket_reso = 512;
  EXPECT_THROW(BucketSelector{options}, InputError);
}

}  // namespace
}  // namespace lorapipe::preprocess
